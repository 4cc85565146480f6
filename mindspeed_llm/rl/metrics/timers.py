"""Named wall-clock timers of one iteration, logged as ``timing/<stage>``; while a profiler records
(`rl/profiling.py`), each timed phase is also a named range of the trace (`set_phase_ranges`), so the phases have
one set of names."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, ContextManager, Dict, Optional

TIMING_PREFIX = "timing/"
# name -> a context manager around the phase (torch.profiler.record_function, an NVTX range); None: no ranges
_PHASE_RANGES: Optional[Callable[[str], ContextManager]] = None


def set_phase_ranges(factory: Optional[Callable[[str], ContextManager]]):
    """Every timer started from now on also opens `factory("timing/<name>")` until it stops (None: stop opening
    them); returns the previous factory. A range opened stays until its timer stops."""
    global _PHASE_RANGES
    previous, _PHASE_RANGES = _PHASE_RANGES, factory
    return previous


def on_stdout(timing_log_level):
    """The stdout line's key filter of --timing-log-level (None: every key): 0 keeps timing/all alone of the timers
    (Megatron-LM's level 0: the iteration time); 1 and 2 every phase."""
    if timing_log_level != 0:
        return None
    return lambda key: not key.startswith(TIMING_PREFIX) or key == TIMING_PREFIX + "all"


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

    def __init__(self, sync: Optional[Callable[[], None]] = None, clock: Callable[[], float] = time.perf_counter):
        self._sync = sync
        self._clock = clock
        self._elapsed: Dict[str, float] = {}
        self._started: Dict[str, float] = {}
        self._ranges: Dict[str, ContextManager] = {}

    def _now(self) -> float:
        if self._sync is not None:
            self._sync()
        return self._clock()

    def start(self, name: str) -> None:
        if name in self._started:
            raise RuntimeError(f"timer '{name}' is already running")
        self._elapsed.setdefault(name, 0.0)
        self._started[name] = self._now()
        if _PHASE_RANGES is not None:
            self._ranges[name] = _PHASE_RANGES(TIMING_PREFIX + name)
            self._ranges[name].__enter__()

    def stop(self, name: str) -> float:
        """Stops ``name``; returns the seconds of this interval."""
        if name not in self._started:
            raise RuntimeError(f"timer '{name}' is not running")
        interval = self._now() - self._started.pop(name)
        self._elapsed[name] += interval
        phase_range = self._ranges.pop(name, None)
        if phase_range is not None:
            phase_range.__exit__(None, None, None)
        return interval

    @contextmanager
    def __call__(self, name: str):
        self.start(name)
        try:
            yield self
        finally:
            self.stop(name)

    def pop(self) -> Dict[str, float]:
        """``{"timing/" + name: seconds}`` for every timer used since the last pop, then resets them.

        Raises if a timer is still running (its interval would be lost or split across iterations).
        """
        if self._started:
            raise RuntimeError(f"cannot pop timers while these are running: {', '.join(self._started)}")
        out = {TIMING_PREFIX + name: seconds for name, seconds in self._elapsed.items()}
        self._elapsed = {}
        return out
