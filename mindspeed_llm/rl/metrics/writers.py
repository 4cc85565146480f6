"""Per-iteration metrics written on rank 0: Megatron-like stdout lines, a JSONL file (continued on resume),
TensorBoard scalars, Weights & Biases (`wandb_writer.py`)."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Callable, Iterable, List, Mapping, Optional, Sequence

from mindspeed_llm.files import append_line, open_for_append, write_text_atomically


def _format_value(value) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.3E}"
    if hasattr(value, "item"):
        return _format_value(value.item())
    return str(value)


def format_log_line(iteration: int, items: Iterable, total_iterations: Optional[int] = None,
                    tag: Optional[str] = None) -> str:
    """`` iteration  3/ 10 | key: 1.234E-01 | ...`` (Megatron-like); ``tag`` adds ``[tag]`` after it."""
    if total_iterations is not None:
        width = len(str(total_iterations)) + 1
        head = f" iteration {iteration:>{width}d}/{total_iterations:>{width}d} |"
    else:
        head = f" iteration {iteration:>8d} |"
    parts = [head]
    if tag:
        parts.append(f" [{tag}]")
    for key, value in items:
        parts.append(f" {key}: {_format_value(value)} |")
    return "".join(parts)


def _json_value(value):
    if hasattr(value, "item") and not isinstance(value, (int, float, str, bool)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no NaN / Infinity
    return value


def _drop_rows_after(path: str, iteration: int) -> None:
    """Keep the rows of iterations <= `iteration` (and no half-written last line), replacing the file atomically."""
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            if int(row.get("iteration", 0)) <= iteration:
                kept.append(json.dumps(row) + "\n")
    write_text_atomically(path, "".join(kept))


class MetricsLogger:
    """Writes per-iteration metrics to stdout, a JSONL file, TensorBoard and Weights & Biases (rank 0 only).

    * stdout: every ``log_interval`` iterations (and at ``total_iterations``), Megatron-like lines
      `` iteration  3/ 10 | actor/pg_loss: 1.234E-01 | ...``. With line groups (``lines``), the keys
      of each group go on their own line tagged ``[group]`` after the ungrouped keys, e.g. an "actor"
      and a "critic" line for PPO.
    * JSONL: one object ``{"iteration": i, **metrics}`` per call (every iteration), flushed at once;
      the file is appended to, so a resumed run continues it: with ``resumed_at`` (the iteration a run
      resumes from) the rows of later iterations, which the resumed run logs again, are dropped first, so
      every iteration has one row. Non-finite floats are written as null.
    * TensorBoard: ``add_scalar(key, value, iteration)`` for every numeric metric, every call.
    * Weights & Biases (``wandb``: `wandb_writer.WandbWriter`'s arguments): ``run.log(metrics, step=iteration)``,
      every call, every metric; ``close(failed=True)`` finishes the wandb run with exit code 1.

    ``lines`` maps a line name to the keys it takes: an entry ending in "/" is a prefix, any other
    entry matches that exact key and the keys under it ("actor" takes "actor" and "actor/..."), e.g.
    ``{"actor": ["actor/", "grad_norm"], "critic": ["critic/"]}``; the first matching line wins.
    Ranks other than 0 write nothing.

    ``progress`` (`progress.Progress`) sees every iteration and puts its items (elapsed time per iteration, elapsed,
    time left) first on the ungrouped stdout line; ``on_stdout(key)`` False leaves a key off the stdout lines
    (not the JSONL nor TensorBoard): --timing-log-level 0.
    """

    def __init__(self, log_interval: int = 1, jsonl_path: Optional[str] = None,
                 tensorboard_dir: Optional[str] = None, rank: int = 0,
                 total_iterations: Optional[int] = None,
                 lines: Optional[Mapping[str, Sequence[str]]] = None,
                 print_fn: Callable[[str], None] = None, resumed_at: Optional[int] = None,
                 wandb: Optional[Mapping[str, object]] = None,
                 progress=None, on_stdout: Optional[Callable[[str], bool]] = None):
        if int(log_interval) < 1:
            raise ValueError(f"log_interval must be >= 1, got {log_interval}")
        self.log_interval = int(log_interval)
        self.rank = int(rank)
        self.total_iterations = total_iterations
        self.lines = dict(lines) if lines else None
        self._print = print_fn or (lambda s: print(s, flush=True, file=sys.stdout))
        self.progress = progress
        self._on_stdout = on_stdout
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._closed = False
        self._jsonl_path, self._resumed_at = jsonl_path, resumed_at
        self._sample_files = {}  # kind -> the open <kind>.jsonl (`log_samples`)
        if self.rank == 0 and jsonl_path:
            parent = os.path.dirname(os.path.abspath(jsonl_path))
            os.makedirs(parent, exist_ok=True)
            if resumed_at is not None and os.path.isfile(jsonl_path):
                _drop_rows_after(jsonl_path, resumed_at)
            self._jsonl = open_for_append(jsonl_path)
        if self.rank == 0 and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=tensorboard_dir)
        if self.rank == 0 and wandb:
            from mindspeed_llm.rl.metrics.wandb_writer import WandbWriter  # imports wandb: only when asked for

            self._wandb = WandbWriter(**wandb)

    @staticmethod
    def _group(metrics: Mapping[str, object], lines: Optional[Mapping[str, Sequence[str]]]):
        if not lines:
            return list(metrics.items()), []
        grouped = {name: [] for name in lines}
        main = []
        for key, value in metrics.items():
            for name, prefixes in lines.items():
                if any(key == p or key.startswith(p if p.endswith("/") else p + "/") for p in prefixes):
                    grouped[name].append((key, value))
                    break
            else:
                main.append((key, value))
        return main, [(name, items) for name, items in grouped.items() if items]

    def format_lines(self, iteration: int, metrics: Mapping[str, object], head: Sequence = ()) -> List[str]:
        # the named lines in their order (actor, then critic, as MindSpeed-LLM prints them), then the rest
        main, groups = self._group(metrics, self.lines)
        main = list(head) + main
        out = [format_log_line(iteration, items, self.total_iterations, tag=name) for name, items in groups]
        if main or not groups:
            out.append(format_log_line(iteration, main, self.total_iterations))
        return out

    def log(self, iteration: int, metrics: Mapping[str, object]) -> None:
        if self._closed:
            raise RuntimeError("MetricsLogger is closed")
        if self.rank != 0:
            return
        if self.progress is not None:
            self.progress.observe(iteration, metrics)
        if iteration % self.log_interval == 0 or (self.total_iterations is not None
                                                  and iteration == self.total_iterations):
            head = self.progress.line_items(iteration) if self.progress is not None else ()
            shown = metrics if self._on_stdout is None else {k: v for k, v in metrics.items() if self._on_stdout(k)}
            for line in self.format_lines(iteration, shown, head):
                self._print(line)
        if self._jsonl is not None:
            record = {"iteration": int(iteration)}
            record.update({k: _json_value(v) for k, v in metrics.items()})
            append_line(self._jsonl, json.dumps(record) + "\n")  # a failed write: named, no half line left
        if self._tb is not None:
            for key, value in metrics.items():
                if hasattr(value, "item") and not isinstance(value, (int, float)):
                    value = value.item()
                if isinstance(value, (int, float)):  # bool is an int; NaN is kept (a diverged loss shows)
                    self._tb.add_scalar(key, float(value), iteration)
        if self._wandb is not None:
            self._wandb.log(iteration, metrics)

    def log_samples(self, iteration: int, rows: Sequence[Mapping[str, object]], kind: str = "samples") -> None:
        """A sample table (--log-samples, `samples.py`): `kind` "samples" (rollouts) or "eval_samples" (held-out),
        each row a JSON object with its iteration in `<kind>.jsonl` beside the JSONL of metrics (continued on resume
        like it), a TensorBoard text table under `kind`, and a wandb table. Rank 0 only; nothing for no rows."""
        if self._closed:
            raise RuntimeError("MetricsLogger is closed")
        if self.rank != 0 or not rows:
            return
        from mindspeed_llm.rl.metrics.samples import EVAL_COLUMNS, TRAIN_COLUMNS, markdown_table, shown_columns

        columns = EVAL_COLUMNS if kind == "eval_samples" else TRAIN_COLUMNS
        if self._jsonl_path is not None:
            if kind not in self._sample_files:
                path = os.path.join(os.path.dirname(os.path.abspath(self._jsonl_path)), f"{kind}.jsonl")
                if self._resumed_at is not None and os.path.isfile(path):
                    _drop_rows_after(path, self._resumed_at)
                self._sample_files[kind] = open_for_append(path)
            f = self._sample_files[kind]
            for row in rows:  # a failed write: named, no half line left
                append_line(f, json.dumps({"iteration": int(iteration), **{k: _json_value(v) for k, v in row.items()}})
                            + "\n")
        if self._tb is not None:
            self._tb.add_text(kind, markdown_table(rows, columns), iteration)
        if self._wandb is not None:
            self._wandb.log_table(iteration, kind, shown_columns(rows, columns), rows)

    def close(self, failed: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        for f in self._sample_files.values():
            f.close()
        self._sample_files = {}
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish(exit_code=1 if failed else 0)
            self._wandb = None
