"""Timers, throughput formulas, cross-rank metric reduction and metric writers for the RL stages.

Metric names follow MindSpeed-RL's GRPO / PPO logs: ``timing/<stage>`` (all, rollout, old_log_p,
reference_model, reward_model, rule_reward, critic_model, adv, update, update_critic), ``actor/*``,
``critic/*``, ``grpo/*``, ``response_length/{mean,min,max}``, ``prompt_length/{mean,min,max}`` and the
throughputs ``e2e_tps``, ``update_tps`` and ``vllm_tps`` (alias ``rollout_tps``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import zlib
from contextlib import contextmanager
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence

__all__ = [
    "Timers",
    "TIMING_PREFIX",
    "throughput_metrics",
    "mean_min_max",
    "prefixed",
    "reduce_metrics",
    "MetricsLogger",
    "format_log_line",
]

TIMING_PREFIX = "timing/"

# ----------------------------------------------------------------------------------------------
# Timers
# ----------------------------------------------------------------------------------------------


class Timers:
    """Named wall-clock timers that accumulate seconds over one iteration.

    Usage::

        timers = Timers(sync=device.synchronize)   # mindspeed_llm.device; None: no sync
        with timers("all"):
            with timers("rollout"):
                ...
            with timers("update"):
                ...
        metrics.update(timers.pop())   # {"timing/all": s, "timing/rollout": s, "timing/update": s}

    A name may be entered many times per iteration (the times add up) but not while it is already
    running. ``sync`` (e.g. a device synchronize) is called right before a timer starts and right
    before it stops, so asynchronous accelerator work is attributed to the stage that queued it.
    """

    def __init__(self, sync: Optional[Callable[[], None]] = None, prefix: str = TIMING_PREFIX,
                 clock: Callable[[], float] = time.perf_counter):
        self._sync = sync
        self._prefix = prefix
        self._clock = clock
        self._elapsed: Dict[str, float] = {}
        self._started: Dict[str, float] = {}

    def _now(self) -> float:
        if self._sync is not None:
            self._sync()
        return self._clock()

    def start(self, name: str) -> None:
        if name in self._started:
            raise RuntimeError(f"timer '{name}' is already running")
        self._elapsed.setdefault(name, 0.0)
        self._started[name] = self._now()

    def stop(self, name: str) -> float:
        """Stops ``name``; returns the seconds of this interval."""
        if name not in self._started:
            raise RuntimeError(f"timer '{name}' is not running")
        interval = self._now() - self._started.pop(name)
        self._elapsed[name] += interval
        return interval

    @contextmanager
    def __call__(self, name: str):
        self.start(name)
        try:
            yield self
        finally:
            self.stop(name)

    def pop(self) -> Dict[str, float]:
        """``{prefix + name: seconds}`` for every timer used since the last pop, then resets them.

        Raises if a timer is still running (its interval would be lost or split across iterations).
        """
        if self._started:
            raise RuntimeError(f"cannot pop timers while these are running: {', '.join(self._started)}")
        out = {self._prefix + name: seconds for name, seconds in self._elapsed.items()}
        self._elapsed = {}
        return out


# ----------------------------------------------------------------------------------------------
# Throughput and length statistics
# ----------------------------------------------------------------------------------------------


def _total(values) -> float:
    """A token count given as a number, or per-sample lengths (list / tensor / array) to add up."""
    if isinstance(values, (int, float)):
        return float(values)
    if hasattr(values, "detach"):  # torch tensor
        return float(values.detach().double().sum().item())
    if hasattr(values, "sum") and hasattr(values, "dtype"):  # numpy
        return float(values.sum())
    return float(sum(float(v) for v in values))


def _timing(timings: Mapping[str, float], stage: str) -> Optional[float]:
    for key in (TIMING_PREFIX + stage, stage):
        if key in timings and timings[key] is not None:
            return float(timings[key])
    return None


def throughput_metrics(prompt_tokens, response_tokens, world_size: int,
                       timings: Mapping[str, float]) -> Dict[str, float]:
    """Tokens per second per device, as MindSpeed-RL's GRPO trainer logs them.

    With ``tokens = prompt_tokens + response_tokens``, the total over all samples of the global batch
    (a prompt counts once per sample generated from it, i.e. ``n_samples_per_prompt`` times):

    * ``e2e_tps     = tokens / world_size / timing/all``
    * ``update_tps  = tokens / world_size / timing/update``
    * ``vllm_tps    = tokens / world_size / timing/rollout``  (MindSpeed-RL's name; also logged as
      ``rollout_tps``, since the rollout here is Megatron's own generation, not vLLM)

    Source: MindSpeed-RL ``mindspeed_rl/utils/utils.py::compute_tps`` as called by
    ``mindspeed_rl/trainer/grpo_trainer_hybrid.py`` (``e2e_tps`` with the iteration time,
    ``update_tps`` with ``timing/update``, ``vllm_tps`` with ``timing/rollout``), where tokens are
    ``(response_length/mean + prompt_length/mean) * global_batch_size * n_samples_per_prompt``; the
    metric names are documented in its ``docs/features/log_metrics.md``.

    The trainer calls this on every rank with that rank's own samples (its share of the global batch) and
    ``world_size`` = TP x PP, the devices that hold one model replica, then averages over the DP ranks: with
    equal times on every rank that is the global batch's tokens / all devices / time, MindSpeed-RL's figure.
    ``prompt_tokens`` / ``response_tokens``: totals, or per-sample lengths to add up. ``timings`` may use
    ``timing/<stage>`` or bare ``<stage>`` keys. A throughput whose timing is missing or not positive is
    left out.
    """
    if int(world_size) < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    tokens = _total(prompt_tokens) + _total(response_tokens)
    out: Dict[str, float] = {}
    for name, stage in (("e2e_tps", "all"), ("update_tps", "update"), ("vllm_tps", "rollout")):
        seconds = _timing(timings, stage)
        if seconds is not None and seconds > 0:
            out[name] = tokens / int(world_size) / seconds
    if "vllm_tps" in out:
        out["rollout_tps"] = out["vllm_tps"]
    return out


def prefixed(prefix: str, metrics: Mapping[str, float]) -> Dict[str, float]:
    """``{prefix/key: value}``: a role's metrics under its name (``actor/pg_loss``)."""
    return {f"{prefix}/{k}": float(v) for k, v in metrics.items()}


def mean_min_max(prefix: str, values) -> Dict[str, float]:
    """``{prefix/mean, prefix/min, prefix/max}`` of per-sample values (lengths, scores); empty input gives
    ``{}``."""
    if hasattr(values, "detach"):
        values = [float(v) for v in values.detach().double().reshape(-1).tolist()]
    elif hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = [float(v) for v in values.reshape(-1).tolist()]
    else:
        values = [float(v) for v in values]
    if not values:
        return {}
    return {
        f"{prefix}/mean": sum(values) / len(values),
        f"{prefix}/min": min(values),
        f"{prefix}/max": max(values),
    }


# ----------------------------------------------------------------------------------------------
# Reduction across data-parallel ranks
# ----------------------------------------------------------------------------------------------

_OPS = ("mean", "sum", "max", "min")


def _key_op(key: str, default: str) -> str:
    if key.endswith("/failures"):  # counts: the job's total
        return "sum"
    if key.endswith(("/max", "_max")):
        return "max"
    if key.endswith(("/min", "_min")):
        return "min"
    return default


def reduce_metrics(metrics: Mapping[str, float], group=None, op: str = "mean",
                   device="cpu") -> Dict[str, float]:
    """Reduce scalar metrics over the ranks of ``group`` (default: the world) with one collective.

    Keys ending in ``/max`` or ``_max`` are reduced with MAX, ``/min`` or ``_min`` with MIN, counts (``/failures``)
    with SUM, all others with
    ``op`` ("mean", "sum", "max" or "min"). Keys are sorted so that every rank packs the same layout
    into one float64 tensor on ``device`` (CPU by default; use the current CUDA device with NCCL). The
    tensor also carries a checksum of the key names: ranks that disagree on the keys raise
    ``ValueError`` instead of silently mixing metrics (the key *count* must agree, as the collective's
    shapes must). The single collective is an all_gather; each rank then reduces the gathered
    ``[world, keys]`` table, so mean, max and min need no separate collectives.

    The result keeps the caller's key order. Without an initialised torch.distributed (or with one rank) the
    metrics come back as floats, unchanged.
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {_OPS}, got {op!r}")
    keys = sorted(metrics)
    values = [float(metrics[k]) for k in keys]

    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group=group) == 1:
        return {k: float(v) for k, v in metrics.items()}
    world = dist.get_world_size(group=group)

    signature = float(zlib.crc32("\n".join(keys).encode("utf-8")))  # exact in float64
    local = torch.tensor(values + [signature], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    table = torch.stack(gathered).cpu()  # [world, len(keys) + 1]

    if not bool((table[:, -1] == signature).all()):
        raise ValueError(
            "reduce_metrics: ranks passed different metric keys; every rank must log the same keys "
            f"(this rank: {keys})"
        )
    out: Dict[str, float] = {}
    for j, key in enumerate(keys):
        column = table[:, j]
        key_op = _key_op(key, op)
        if key_op == "mean":
            out[key] = float(column.sum().item()) / world
        elif key_op == "sum":
            out[key] = float(column.sum().item())
        elif key_op == "max":
            out[key] = float(column.max().item())
        else:
            out[key] = float(column.min().item())
    return {k: out[k] for k in metrics}  # the caller's order (log lines print in it)


# ----------------------------------------------------------------------------------------------
# Writers
# ----------------------------------------------------------------------------------------------


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
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)


class MetricsLogger:
    """Writes per-iteration metrics to stdout, a JSONL file and TensorBoard (rank 0 only).

    * stdout: every ``log_interval`` iterations (and at ``total_iterations``), Megatron-like lines
      `` iteration  3/ 10 | actor/pg_loss: 1.234E-01 | ...``. With line groups (``lines``), the keys
      of each group go on their own line tagged ``[group]`` after the ungrouped keys, e.g. an "actor"
      and a "critic" line for PPO.
    * JSONL: one object ``{"iteration": i, **metrics}`` per call (every iteration), flushed at once;
      the file is appended to, so a resumed run continues it: with ``resumed_at`` (the iteration a run
      resumes from) the rows of later iterations, which the resumed run logs again, are dropped first, so
      every iteration has one row. Non-finite floats are written as null.
    * TensorBoard: ``add_scalar(key, value, iteration)`` for every numeric metric, every call.

    ``lines`` maps a line name to the keys it takes: an entry ending in "/" is a prefix, any other
    entry matches that exact key and the keys under it ("actor" takes "actor" and "actor/..."), e.g.
    ``{"actor": ["actor/", "grad_norm"], "critic": ["critic/"]}``; the first matching line wins. It
    can also be passed per ``log`` call.
    Ranks other than 0 write nothing.
    """

    def __init__(self, log_interval: int = 1, jsonl_path: Optional[str] = None,
                 tensorboard_dir: Optional[str] = None, rank: int = 0,
                 total_iterations: Optional[int] = None,
                 lines: Optional[Mapping[str, Sequence[str]]] = None,
                 print_fn: Callable[[str], None] = None, resumed_at: Optional[int] = None):
        if int(log_interval) < 1:
            raise ValueError(f"log_interval must be >= 1, got {log_interval}")
        self.log_interval = int(log_interval)
        self.rank = int(rank)
        self.total_iterations = total_iterations
        self.lines = dict(lines) if lines else None
        self._print = print_fn or (lambda s: print(s, flush=True, file=sys.stdout))
        self._jsonl = None
        self._tb = None
        self._closed = False
        if self.rank == 0 and jsonl_path:
            parent = os.path.dirname(os.path.abspath(jsonl_path))
            os.makedirs(parent, exist_ok=True)
            if resumed_at is not None and os.path.exists(jsonl_path):
                _drop_rows_after(jsonl_path, resumed_at)
            self._jsonl = open(jsonl_path, "a", encoding="utf-8")
        if self.rank == 0 and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=tensorboard_dir)

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

    def format_lines(self, iteration: int, metrics: Mapping[str, object],
                     lines: Optional[Mapping[str, Sequence[str]]] = None) -> List[str]:
        # the named lines in their order (actor, then critic, as MindSpeed-LLM prints them), then the rest
        main, groups = self._group(metrics, lines if lines is not None else self.lines)
        out = [format_log_line(iteration, items, self.total_iterations, tag=name) for name, items in groups]
        if main or not groups:
            out.append(format_log_line(iteration, main, self.total_iterations))
        return out

    def log(self, iteration: int, metrics: Mapping[str, object],
            lines: Optional[Mapping[str, Sequence[str]]] = None) -> None:
        if self._closed:
            raise RuntimeError("MetricsLogger is closed")
        if self.rank != 0:
            return
        if iteration % self.log_interval == 0 or (self.total_iterations is not None
                                                  and iteration == self.total_iterations):
            for line in self.format_lines(iteration, metrics, lines):
                self._print(line)
        if self._jsonl is not None:
            record = {"iteration": int(iteration)}
            record.update({k: _json_value(v) for k, v in metrics.items()})
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if hasattr(value, "item") and not isinstance(value, (int, float)):
                    value = value.item()
                if isinstance(value, (int, float)):  # bool is an int; NaN is kept (a diverged loss shows)
                    self._tb.add_scalar(key, float(value), iteration)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
