"""Named wall-clock timers of one iteration, logged as ``timing/<stage>``."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Dict, Optional

TIMING_PREFIX = "timing/"


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
        """``{"timing/" + name: seconds}`` for every timer used since the last pop, then resets them.

        Raises if a timer is still running (its interval would be lost or split across iterations).
        """
        if self._started:
            raise RuntimeError(f"cannot pop timers while these are running: {', '.join(self._started)}")
        out = {TIMING_PREFIX + name: seconds for name, seconds in self._elapsed.items()}
        self._elapsed = {}
        return out
