"""Megatron-LM's profiling and observability flags, checked and resolved (`validate_args` calls `check_profiling`):
the profiled window and ranks, where the traces go (`trace_dir`), and the startup notes for the flags that are
accepted with a counterpart here (--log-throughput, --timing-log-option, --timing-log-level 2). The device-dependent
notes (nsys and the memory history need CUDA) are `rl/profiling.startup_notes`'. Also the sample tables
(--log-samples) and the rollout dump and replay (--rollout-dump-dir, --rollout-replay-dir): `check_rollout_records`."""

from __future__ import annotations

import os

from mindspeed_llm.errors import ArgumentError

THROUGHPUTS = "e2e_tps, update_tps, vllm_tps / rollout_tps"


def check_profiling(run) -> None:
    """`run`: validation's view of the Namespace (`validation._Resolving`); sets `trace_dir`, adds startup notes."""
    run.trace_dir = None
    if run.log_throughput:
        run.startup_notes.append(f"--log-throughput: the throughputs are always logged here ({THROUGHPUTS}: tokens "
                                 "per second per device, docs/metrics.md); there is no TFLOP/s figure")
    if run.timing_log_option is not None:
        run.startup_notes.append(f"--timing-log-option {run.timing_log_option}: timing/* are the mean over the "
                                 "data-parallel ranks here (no per-rank max / min)")
    if run.timing_log_level == 2:
        run.startup_notes.append("--timing-log-level 2: the timers here are the phases of an iteration (level 1's); "
                                 "none is finer, so it logs what 1 does")
    if run.use_pytorch_profiler and not run.profile:
        run.startup_notes.append("--use-pytorch-profiler without --profile profiles nothing (Megatron-LM's rule); "
                                 "add --profile")
    extras = [flag for flag, on in (("--pytorch-profiler-collect-shapes", run.pytorch_profiler_collect_shapes),
                                    ("--pytorch-profiler-collect-callstack", run.pytorch_profiler_collect_callstack),
                                    ("--profile-with-memory", run.profile_with_memory)) if on]
    if extras and not run.profile:
        raise ArgumentError(f"{' and '.join(extras)} {'has' if len(extras) == 1 else 'have'} no effect without "
                            "--profile --use-pytorch-profiler (what a trace records); add them or drop the flag")
    if not run.profile:
        return
    # Megatron-LM's window: it starts once --profile-step-start iterations are done and stops once
    # --profile-step-end are: iterations start + 1 .. end as logged (0 1: the first iteration alone)
    start, end = run.profile_step_start, run.profile_step_end
    valid = (f"give 0 <= --profile-step-start < --profile-step-end <= --train-iters ({run.train_iters}); the "
             f"profiled iterations are start + 1 .. end as logged (Megatron-LM's: the window opens once start "
             f"iterations are done and closes once end are)")
    if end <= start:
        raise ArgumentError(f"--profile-step-start {start} --profile-step-end {end} profiles no iteration: {valid}, "
                            f"e.g. --profile-step-start {start} --profile-step-end {start + 1} for iteration "
                            f"{start + 1} alone")
    if start >= run.train_iters:
        raise ArgumentError(f"--profile-step-start {start}: the run ends after --train-iters {run.train_iters}, before "
                            f"the window opens, so nothing would be profiled; {valid}, e.g. --profile-step-start 1 "
                            "--profile-step-end 3")
    outside = [rank for rank in run.profile_ranks if not 0 <= rank < run.world_size]
    if outside:
        raise ArgumentError(f"--profile-ranks {' '.join(map(str, outside))}: not a rank of this run (0 .. "
                            f"{run.world_size - 1})")
    torch_only = [flag for flag in extras if flag != "--pytorch-profiler-collect-shapes"]
    if torch_only and not run.use_pytorch_profiler:  # nsys's range takes the shapes alone
        raise ArgumentError(f"{' and '.join(torch_only)} record{'s' if len(torch_only) == 1 else ''} into a "
                            "torch.profiler trace: add --use-pytorch-profiler (--profile alone is nsys's capture range)")
    if run.use_pytorch_profiler:
        base = run.tensorboard_dir or run.save
        if not base:
            raise ArgumentError("--profile --use-pytorch-profiler writes its traces under --tensorboard-dir (or "
                                "--save): give one of them")
        run.trace_dir = os.path.join(base, "profile")
    if end > run.train_iters:
        run.startup_notes.append(f"--profile-step-end {end}: the run ends at --train-iters {run.train_iters}, so "
                                 f"iterations {start + 1} .. {run.train_iters} are profiled")


def check_rollout_records(run) -> None:
    """--log-samples needs somewhere to write (--metrics-jsonl's folder, --tensorboard-dir or wandb) and its interval
    defaults to --log-interval; --rollout-dump-dir and --rollout-replay-dir are two different folders, and a replay
    folder must hold a dump (`rl/rollouts/dump.read_manifest`, which checks the run against it when the stage starts)."""
    if run.log_samples_interval is not None and not run.log_samples:
        raise ArgumentError(f"--log-samples-interval {run.log_samples_interval} without --log-samples N logs no "
                            "sample; add --log-samples N (rows per table)")
    run.log_samples_interval = run.log_samples_interval or run.log_interval
    if run.log_samples and not (run.metrics_jsonl or run.tensorboard_dir or run.wandb_project):
        raise ArgumentError(f"--log-samples {run.log_samples} writes samples.jsonl beside --metrics-jsonl and a "
                            "TensorBoard / wandb table: give --metrics-jsonl FILE (or --tensorboard-dir, "
                            "--wandb-project)")
    _check_jsonl_files(run)
    dump, replay = run.rollout_dump_dir, run.rollout_replay_dir
    if dump and replay and os.path.abspath(dump) == os.path.abspath(replay):
        raise ArgumentError(f"--rollout-dump-dir and --rollout-replay-dir are both {dump}: the replay would write over "
                            "the rollouts it reads; give the dump another folder (or drop it: a replay's rollouts "
                            "are the dump's)")
    if dump and os.path.exists(dump) and not os.path.isdir(dump):
        raise ArgumentError(f"--rollout-dump-dir {dump} is a file; pass a directory")
    if replay:
        from mindspeed_llm.rl.rollouts.dump import MANIFEST

        if not os.path.isfile(os.path.join(replay, MANIFEST)):
            raise ArgumentError(f"--rollout-replay-dir {replay} holds no rollout dump ({MANIFEST} is missing): pass "
                                "the --rollout-dump-dir of the run to replay")


def _check_jsonl_files(run) -> None:
    """--metrics-jsonl and the sample tables beside it (samples.jsonl, eval_samples.jsonl with --log-samples) must
    be files a run can append to: a directory in their place is refused now, not after an iteration trained."""
    if not run.metrics_jsonl:
        return
    folder = os.path.dirname(os.path.abspath(run.metrics_jsonl))
    files = [("--metrics-jsonl", run.metrics_jsonl)]
    if run.log_samples:
        files += [(f"--log-samples {run.log_samples}", os.path.join(folder, f"{kind}.jsonl"))
                  for kind in ("samples", "eval_samples")]
    for flag, path in files:
        if os.path.isdir(path):
            raise ArgumentError(f"{flag} appends to {path}, which is a directory; move it away (or give "
                                "--metrics-jsonl a file in another folder: the sample tables are written beside it)")
