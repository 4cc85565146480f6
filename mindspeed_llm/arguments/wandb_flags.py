"""Checking the Weights & Biases flags (Megatron-LM's `--wandb-project`, `--wandb-exp-name`, `--wandb-save-dir`,
`--wandb-entity`) and resolving where and how the run logs: wandb is an optional dependency, imported only when
`--wandb-project` asks for it, so a missing install is an `ArgumentError` before any model is built.

The mode: `WANDB_MODE` when set (wandb's own variable: online, offline, disabled); else online when an API key is
configured (`WANDB_API_KEY`, or the ~/.netrc entry `wandb login` writes), offline otherwise, with a startup note
saying so and how to upload the run later (`wandb sync`). A run that starts online but cannot reach the server falls
back to offline (`rl/metrics/wandb_writer.py`).
"""

from __future__ import annotations

import netrc
import os
from typing import Mapping
from urllib.parse import urlsplit

from mindspeed_llm.errors import ArgumentError

# The version the tests run against (requirements-test.txt pins the same; tests/unit/test_wandb.py checks it).
WANDB_REQUIREMENT = "wandb==0.31.0"
DEFAULT_BASE_URL = "https://api.wandb.ai"
OTHER_FLAGS = ("wandb_exp_name", "wandb_save_dir", "wandb_entity")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_installed() -> None:
    """`ArgumentError` naming the flag and the pinned install when wandb cannot be imported."""
    try:
        import wandb  # noqa: F401  (only to know it is there: the writer imports it on rank 0)
    except ImportError as exc:
        raise ArgumentError(f"--wandb-project needs the wandb package, which is not installed ({exc}); "
                            f"`pip install {WANDB_REQUIREMENT}`, or drop --wandb-project") from None


def has_api_key(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether wandb would find credentials: `WANDB_API_KEY`, or a .netrc entry (`NETRC`, else ~/.netrc) for the
    host of `WANDB_BASE_URL` (api.wandb.ai by default), the one `wandb login` writes."""
    if environ.get("WANDB_API_KEY"):
        return True
    host = urlsplit(environ.get("WANDB_BASE_URL") or DEFAULT_BASE_URL).netloc
    path = environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return bool(netrc.netrc(path).authenticators(host))
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_mode(environ: Mapping[str, str] = os.environ) -> tuple:
    """(mode, note): `WANDB_MODE` when set, else online with an API key and offline without one (the note says
    so; None otherwise)."""
    mode = environ.get("WANDB_MODE")
    if mode:
        return mode, None
    if has_api_key(environ):
        return "online", None
    return "offline", ("no wandb API key (WANDB_API_KEY or `wandb login`) and WANDB_MODE unset: wandb logs "
                       "offline")


def check_wandb(run, environ: Mapping[str, str] = os.environ) -> None:
    """Resolve `run.wandb_save_dir` and `run.wandb_mode` (`validation._Resolving`) and refuse the flags that would
    do nothing; adds the mode's startup note to `run.startup_notes`."""
    run.wandb_mode = None
    if run.wandb_project is not None and not run.wandb_project.strip():
        raise ArgumentError(f"--wandb-project {run.wandb_project!r} is empty: it would turn wandb off without a word; "
                            "name the project (--wandb-project my-project), or drop the flag to log without wandb")
    if not run.wandb_project:
        given = [_flag(dest) for dest in OTHER_FLAGS if getattr(run, dest)]
        if given:
            raise ArgumentError(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect without "
                                "--wandb-project PROJECT (wandb is off without it)")
        return
    check_installed()
    if not run.wandb_save_dir and run.save:
        run.wandb_save_dir = os.path.join(run.save, "wandb")  # Megatron-LM's default
    run.wandb_mode, note = resolve_mode(environ)
    if note:
        where = run.wandb_save_dir or os.path.join(os.getcwd(), "wandb")
        run.startup_notes.append(f"--wandb-project {run.wandb_project}: {note} to {where}/wandb/offline-run-*; "
                                 "upload it later with `wandb sync DIR` (WANDB_MODE=online to log online)")
