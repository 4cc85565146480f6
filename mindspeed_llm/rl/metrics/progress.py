"""The run's progress as a person reads it: each stdout line's elapsed time per iteration (Megatron-LM's
`elapsed time per iteration (ms)`, the mean since the previous line), the time since the run began and an estimate
of the time left; and the end-of-run summary (iterations done, best and last held-out score, where the outputs are).
`MetricsLogger` asks it for the line's items; `trainer.run` prints the summary."""

from __future__ import annotations

import math
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import re

# a held-out set's mean score: `eval/score/mean` (the unnamed set) or `eval/NAME/score/mean` (--eval-data-path
# NAME=PREFIX; not its data sources' `eval/NAME/SOURCE/score/mean`)
EVAL_SCORE = re.compile(r"^eval/(?:[^/]+/)?score/mean$")


def clock_text(seconds: float) -> str:
    """`H:MM:SS` (days add up in the hours)."""
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Times the iterations a run logs (`observe`, every iteration) and keeps each held-out set's score
    (`eval/score/mean`, `eval/NAME/score/mean`: the best and the last, with their iterations). `start_iteration`: the iteration the run
    continues from (0, or the resumed checkpoint's); `clock`: seconds (monotonic)."""

    def __init__(self, total_iterations: int, start_iteration: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        self.total = int(total_iterations)
        self.start_iteration = int(start_iteration)
        self._clock = clock
        self.began = clock()
        self._line_time, self._line_iteration = self.began, self.start_iteration
        self.last_iteration: Optional[int] = None
        self.best_eval: Dict[str, Tuple[int, float]] = {}  # metric -> (iteration, score)
        self.last_eval: Dict[str, Tuple[int, float]] = {}
        self._now = self.began

    def observe(self, iteration: int, metrics: Mapping[str, object]) -> None:
        self._now = self._clock()
        self.last_iteration = int(iteration)
        for key, score in metrics.items():
            if EVAL_SCORE.match(key) and score is not None and math.isfinite(float(score)):
                self.last_eval[key] = (int(iteration), float(score))
                if key not in self.best_eval or float(score) > self.best_eval[key][1]:
                    self.best_eval[key] = self.last_eval[key]

    def line_items(self, iteration: int) -> List[Tuple[str, str]]:
        """The items of the stdout line of `iteration` (after `observe`): the mean time of the iterations since the
        previous line, the elapsed time and the estimate of what is left (at the mean pace of this run so far)."""
        done = iteration - self.start_iteration
        since = iteration - self._line_iteration
        per_iteration = (self._now - self._line_time) / since if since > 0 else 0.0
        self._line_time, self._line_iteration = self._now, iteration
        elapsed = self._now - self.began
        left = elapsed / done * max(0, self.total - iteration) if done > 0 else 0.0
        return [("elapsed time per iteration (ms)", f"{per_iteration * 1000:.1f}"),
                ("elapsed", clock_text(elapsed)), ("time left", clock_text(left))]

    def summary_lines(self, outputs: Sequence[Tuple[str, Optional[str]]] = ()) -> List[str]:
        """The end-of-run summary: iterations done and how long they took, each held-out set's best and last score
        (when evaluated), and each `(what, where)` of `outputs` that is set."""
        if self.last_iteration is None:
            lines = [f"run summary: no iteration ran (the run was at iteration {self.start_iteration} of {self.total})"]
        else:
            done = self.last_iteration - self.start_iteration
            elapsed = self._now - self.began
            lines = [f"run summary: iterations {self.start_iteration + 1} .. {self.last_iteration} of {self.total} "
                     f"done in {clock_text(elapsed)} ({elapsed / max(done, 1):.2f} s per iteration)"]
        for key, (best_at, best) in self.best_eval.items():
            last_at, last = self.last_eval[key]
            lines.append(f"  {key}: best {best:.4f} (iteration {best_at}), last {last:.4f} (iteration {last_at})")
        lines.extend(f"  {what}: {where}" for what, where in outputs if where)
        return lines
