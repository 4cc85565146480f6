"""Megatron-LM's profiling flags around the outer loop (`trainer._loop` calls `begin` / `end` per iteration).

* `--profile --use-pytorch-profiler`: a `torch.profiler.profile` (`torch_npu.profiler` on NPU, through
  `device.profiler_api`; unverified until run on an NPU) records iterations `--profile-step-start` + 1 ..
  `--profile-step-end` as logged (Megatron-LM's window: it opens once `--profile-step-start` iterations are done and
  closes once `--profile-step-end` are; 0 1 is the first iteration; the iteration before the window is its warmup,
  as Megatron-LM's schedule has it) on the ranks `--profile-ranks`, and writes one trace per rank with
  `tensorboard_trace_handler` to `<--tensorboard-dir, else --save>/profile` (`rank<R>.<ns>.pt.trace.json`: TensorBoard's
  profiler plugin, Perfetto and chrome://tracing open it). Every timed phase of an iteration (`timing/rollout`,
  `timing/old_log_p`, `timing/reference_model`, `timing/update`, ...: the stages' `Timers`) is a named range in
  it (`timers.set_phase_ranges`). It records the ops' times alone unless asked for more, as each multiplies its
  size (docs/monitoring.md has the figures): `--pytorch-profiler-collect-shapes` (input shapes),
  `--pytorch-profiler-collect-callstack` (Python stacks; Megatron-LM's names, MindSpeed's `--profile-record-shapes`
  / `--profile-with-stack` too), `--profile-with-memory` (allocations). A run resumed past the window says so
  (`Profiler.resumed`) and writes nothing.
* `--profile` alone: nsys's capture range on CUDA (cudaProfilerStart / Stop around the same iterations, NVTX ranges
  for the phases and, through `emit_nvtx`, the ops); no effect elsewhere (said at startup).
* `--record-memory-history`: on CUDA the last rank records the allocator's history and dumps it to
  `--memory-snapshot-path` every `--log-interval` and at the end (Megatron-LM's); no effect elsewhere (said at
  startup).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import List, Optional

import torch

from mindspeed_llm import device
from mindspeed_llm.rl.metrics import timers
from mindspeed_llm.rl.settings import ProfileSettings


def startup_notes(settings: ProfileSettings, kind: str) -> List[str]:
    """What the profiling flags do on this device (`kind`: cpu / cuda / npu), for the startup lines."""
    notes = []
    start, last = settings.profile_step_start + 1, settings.profile_step_end
    window = f"iterations {start} .. {last} on ranks {' '.join(map(str, settings.profile_ranks))}"
    if settings.profile and settings.use_pytorch_profiler:
        which = "torch_npu.profiler (unverified on an NPU)" if kind == "npu" else "torch.profiler"
        recorded = [what for what, on in (("shapes", settings.pytorch_profiler_collect_shapes),
                                          ("call stacks", settings.pytorch_profiler_collect_callstack),
                                          ("memory", settings.profile_with_memory)) if on]
        notes.append(f"--profile --use-pytorch-profiler: {which} traces of {window} in {settings.trace_dir} "
                     "(TensorBoard's profiler plugin, or Perfetto), the phases as timing/* ranges; "
                     + (f"with the ops' {', '.join(recorded)}" if recorded else
                        "the ops' times only (--pytorch-profiler-collect-shapes, --pytorch-profiler-collect-callstack, "
                        "--profile-with-memory record more, in a larger trace)"))
    elif settings.profile and kind == "cuda":
        notes.append(f"--profile: nsys's capture range (cudaProfilerStart / Stop) around {window}; run under "
                     "`nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop`")
    elif settings.profile:
        notes.append(f"--profile without --use-pytorch-profiler is nsys's capture range, which needs CUDA: no effect "
                     f"on {kind} (add --use-pytorch-profiler for traces)")
    if settings.record_memory_history and kind == "cuda":
        notes.append(f"--record-memory-history: the last rank records the CUDA allocator's history and dumps it to "
                     f"{settings.memory_snapshot_path} every --log-interval (open it at pytorch.org/memory_viz)")
    elif settings.record_memory_history:
        notes.append(f"--record-memory-history / --memory-snapshot-path need CUDA (torch.cuda.memory): no effect "
                     f"on {kind}")
    elif settings.memory_snapshot_path != ProfileSettings.memory_snapshot_path:
        notes.append("--memory-snapshot-path without --record-memory-history: nothing is recorded")
    return notes


@contextlib.contextmanager
def _nvtx_range(name: str):
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


class Profiler:
    """The profiler of one rank (module doc); `close` ends a window the run cut short. `kind`: the device (default:
    this process's)."""

    def __init__(self, settings: ProfileSettings, rank: int, world_size: int, kind: Optional[str] = None):
        self.settings = settings
        self.rank = rank
        self.kind = kind or device.accelerator().kind
        # as logged, the end excluded: Megatron-LM's window opens once profile_step_start iterations are done
        self.window_start, self.window_end = settings.profile_step_start + 1, settings.profile_step_end + 1
        self.mode = None  # "torch" | "nsys" | None: nothing to do on this rank
        if settings.profile and rank in settings.profile_ranks:
            if settings.use_pytorch_profiler:
                self.mode = "torch"
            elif self.kind == "cuda":
                self.mode = "nsys"
        self.passed_at: Optional[int] = None  # the iteration a run resumed at, past the whole window (`resumed`)
        self.profiled: List[int] = []  # the iterations recorded
        self.traces: List[str] = []  # the trace files written
        self._prof = None
        self._nvtx = None
        self._open = False
        self._closed = False
        self._previous_ranges = None
        self.snapshot_path = None
        if settings.record_memory_history and rank == world_size - 1 and self.kind == "cuda":
            device.record_memory_history(True)
            self.snapshot_path = settings.memory_snapshot_path

    def resumed(self, start: int) -> Optional[str]:
        """The run continues after iteration `start` (a resumed checkpoint's): when that is past the whole window,
        nothing is profiled and the line returned says so (None otherwise, or when nothing is profiled anyway)."""
        if not self.settings.profile or start < self.window_end - 1:
            return None
        self.passed_at = start
        return (f"--profile: this run resumes after iteration {start}, past the profiled window (iterations "
                f"{self.window_start} .. {self.window_end - 1}): nothing is profiled and no trace is written; give "
                f"--profile-step-start {start} or more (and a later --profile-step-end) to profile this run")

    def begin(self, iteration: int) -> None:
        """Before `iteration`: opens the window at its first iteration (a torch profiler one earlier, to warm up)."""
        first = self.window_start - 1 if self.mode == "torch" else self.window_start
        if self.mode is None or self._open or not (first <= iteration < self.window_end) or self.profiled:
            return
        if self.mode == "torch":
            self._start_torch(iteration)
            self._previous_ranges = timers.set_phase_ranges(torch.autograd.profiler.record_function)
        else:
            device.cuda_profiler_range(True)
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=self.settings.pytorch_profiler_collect_shapes)
            self._nvtx.__enter__()
            self._previous_ranges = timers.set_phase_ranges(_nvtx_range)
        self._open = True

    def _start_torch(self, iteration: int) -> None:
        api, activities = device.profiler_api()
        first = max(self.window_start, iteration)
        with warnings.catch_warnings():  # a window that starts at the run's first iteration has no warmup
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            schedule = api.schedule(wait=0, warmup=first - iteration, active=self.window_end - first, repeat=1)
        handler = api.tensorboard_trace_handler(self.settings.trace_dir, worker_name=f"rank{self.rank}")

        def ready(prof):
            before = set(os.listdir(self.settings.trace_dir)) if os.path.isdir(self.settings.trace_dir) else set()
            handler(prof)
            self.traces.extend(sorted(os.path.join(self.settings.trace_dir, name)
                                      for name in set(os.listdir(self.settings.trace_dir)) - before))

        self._prof = api.profile(activities=activities, schedule=schedule, on_trace_ready=ready,
                                 record_shapes=self.settings.pytorch_profiler_collect_shapes,
                                 with_stack=self.settings.pytorch_profiler_collect_callstack,
                                 profile_memory=self.settings.profile_with_memory)
        self._prof.start()

    def end(self, iteration: int) -> None:
        """After `iteration`: closes the window after its last iteration; dumps the memory snapshot every
        --log-interval."""
        if self._open:
            if iteration >= self.window_start:
                self.profiled.append(iteration)
            if self._prof is not None:
                self._prof.step()
            if iteration >= self.window_end - 1:
                self._stop()
        if self.snapshot_path and iteration % self.settings.log_interval == 0:
            device.dump_memory_snapshot(self.snapshot_path)

    def _stop(self) -> None:
        self._open = False
        timers.set_phase_ranges(self._previous_ranges)
        if self._prof is not None:
            self._prof.stop()  # writes the trace when the schedule has not yet (a window cut short)
            self._prof = None
        else:
            self._nvtx.__exit__(None, None, None)
            self._nvtx = None
            device.cuda_profiler_range(False)

    def close(self) -> None:
        """At the end of the run (also when it stops early): a window still open is closed and written."""
        if self._open:
            self._stop()
        if self.snapshot_path and not self._closed:
            device.dump_memory_snapshot(self.snapshot_path)
            device.record_memory_history(False)
        self._closed = True

    def summary_lines(self) -> List[str]:
        """Where this rank's outputs are, for the end-of-run summary."""
        lines = []
        if self.passed_at is not None:
            lines.append(f"profiler: no trace (the run resumed after iteration {self.passed_at}, past the window "
                         f"{self.window_start} .. {self.window_end - 1})")
        elif self.settings.profile and self.settings.use_pytorch_profiler:
            mine = f"; this rank's: {', '.join(self.traces)}" if self.traces else ""
            lines.append(f"profiler traces: {self.settings.trace_dir} (ranks "
                         f"{' '.join(map(str, self.settings.profile_ranks))}{mine})")
        if self.snapshot_path:
            lines.append(f"memory snapshot: {self.snapshot_path}")
        return lines
