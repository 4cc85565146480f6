"""The Weights & Biases writer of `MetricsLogger` (rank 0 only): one wandb run per training run, every metric the
other writers get, logged with the iteration as the step; `finish` at the end of the run (exit code 1 when it
failed). wandb is imported here only, when a run asks for it (`--wandb-project`; `arguments/wandb_flags.py` checks
the install and resolves the mode before any model is built).

A resumed run is a new wandb run: its steps continue from the checkpoint's iteration.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Mapping, Optional

INIT_MODES = ("online", "offline", "disabled", "shared")  # wandb.init's; WANDB_MODE also takes legacy spellings


def wandb_options(settings) -> Optional[dict]:
    """`WandbWriter`'s arguments for the run's `Settings` (its config: the settings as a dict), or None without
    --wandb-project."""
    w = settings.wandb
    if not w.wandb_project:
        return None
    return dict(project=w.wandb_project, name=w.wandb_exp_name, save_dir=w.wandb_save_dir, entity=w.wandb_entity,
                mode=w.wandb_mode, config=dataclasses.asdict(settings))


def _plain(value):
    """A Python number for a tensor / numpy scalar; anything else as it is (NaN stays NaN: a diverged loss shows)."""
    if hasattr(value, "item") and not isinstance(value, (bool, int, float, str)):
        return value.item()
    return value


def _cell(value):
    """A table cell wandb takes: numbers and text as they are, anything else (score parts, turns) as JSON text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    import json

    return json.dumps(value)


class WandbWriter:
    """`wandb.init(project, name, dir, entity, config, mode)`; a run that starts online but cannot reach the server
    continues offline (and says so)."""

    def __init__(self, project: str, name: Optional[str] = None, save_dir: Optional[str] = None,
                 entity: Optional[str] = None, mode: Optional[str] = None, config: Optional[Mapping] = None,
                 print_fn: Callable[[str], None] = None):
        import wandb

        self._print = print_fn or (lambda s: print(s, flush=True))
        kwargs = dict(project=project, name=name, entity=entity, config=dict(config or {}),
                      mode=mode if mode in INIT_MODES else None)  # None: wandb reads WANDB_MODE itself
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
            kwargs["dir"] = save_dir
        try:
            self.run = wandb.init(**kwargs)
        except wandb.Error as exc:
            if mode != "online":
                raise
            self._print(f"posttrain_gpt.py: wandb cannot reach its server ({exc}); logging offline instead "
                        "(`wandb sync` uploads the run later)")
            self.run = wandb.init(**{**kwargs, "mode": "offline"})
        self._finished = False

    def log(self, iteration: int, metrics: Mapping[str, object]) -> None:
        self.run.log({key: _plain(value) for key, value in metrics.items()}, step=int(iteration))

    def log_table(self, iteration: int, key: str, columns, rows) -> None:
        """A sample table (--log-samples) as a wandb Table under `key`, at the iteration's step."""
        import wandb

        table = wandb.Table(columns=list(columns), data=[[_cell(r.get(c)) for c in columns] for r in rows])
        self.run.log({key: table}, step=int(iteration))

    def finish(self, exit_code: int = 0) -> None:
        if not self._finished:
            self._finished = True
            self.run.finish(exit_code=exit_code)
