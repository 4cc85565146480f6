"""Megatron-LM's profiling flags (`rl/profiling.py`, `arguments/observability.py`) and the progress line
(`rl/metrics/progress.py`): the flags parse and reach `settings.profile`, their refusals and startup lines; the
profiler writes one trace per chosen rank holding exactly the window's iterations, with the timers' phases as named
ranges; nsys's range and the memory snapshot on (stand-in) CUDA; the stdout line's elapsed / time left and the end
summary."""

import glob
import json
import os

import pytest
import torch

from mindspeed_llm.arguments import parse_args
from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.rl import profiling
from mindspeed_llm.rl.metrics import MetricsLogger, Progress, Timers, timers
from mindspeed_llm.rl.settings import ProfileSettings
from mindspeed_llm.rl.startup import startup_lines

BASE = ["--stage", "grpo", "--verifier-function", "math_acc", "--data-path", "d", "--train-iters", "5",
        "--global-batch-size", "4", "--ref-model", "r"]


def test_the_flags_reach_the_settings(tmp_path):
    args = parse_args(BASE + ["--profile", "--use-pytorch-profiler", "--profile-step-start", "2",
                              "--profile-step-end", "4", "--profile-ranks", "0", "1", "--tensorboard-dir",
                              str(tmp_path), "--record-memory-history", "--memory-snapshot-path", "m.pickle",
                              "--timing-log-level", "0", "--log-throughput", "--timing-log-option", "max",
                              "--log-interval", "2"], world_size=2)
    assert args.settings.profile == ProfileSettings(
        profile=True, use_pytorch_profiler=True, profile_step_start=2, profile_step_end=4, profile_ranks=(0, 1),
        record_memory_history=True, memory_snapshot_path="m.pickle", timing_log_level=0, log_interval=2,
        trace_dir=str(tmp_path / "profile"))
    defaults = parse_args(BASE).settings.profile  # Megatron-LM's defaults
    assert (defaults.profile, defaults.profile_step_start, defaults.profile_step_end, defaults.profile_ranks,
            defaults.trace_dir) == (False, 10, 12, (0,), None)
    assert parse_args(BASE + ["--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
                              "--profile-step-end", "2", "--save", "s"]).settings.profile.trace_dir == "s/profile"


@pytest.mark.parametrize("extra,needle", [
    (["--profile-step-start", "3", "--profile-step-end", "3"], "--profile-step-start 3 --profile-step-end 3 "
                                                               "profiles no iteration"),
    (["--pytorch-profiler-collect-callstack", "--profile-step-start", "2", "--profile-step-end", "3"],
     "--pytorch-profiler-collect-callstack records into a torch.profiler trace: add --use-pytorch-profiler"),
    ([], "--profile-step-start 10: the run ends after --train-iters 5, before the window opens"),  # Megatron-LM's defaults on a short run
    (["--profile-step-start", "2", "--profile-step-end", "3", "--profile-ranks", "1"], "--profile-ranks 1: not a rank"),
    (["--profile-step-start", "2", "--profile-step-end", "3", "--use-pytorch-profiler"], "give one of them"),
    (["--profile-step-start", "-1"], "--profile-step-start -1 must be >= 0"),
])
def test_a_profile_that_cannot_happen_is_refused(extra, needle):
    with pytest.raises(ArgumentError, match=needle):
        parse_args(BASE + ["--profile"] + extra)


def test_the_startup_lines_say_what_each_flag_does_on_cpu():
    args = parse_args(BASE + ["--profile", "--profile-step-start", "2", "--profile-step-end", "9",
                              "--record-memory-history", "--log-throughput", "--timing-log-option", "minmax",
                              "--timing-log-level", "2"])
    text = "\n".join(startup_lines(args.settings, "gloo"))
    assert "--profile without --use-pytorch-profiler is nsys's capture range, which needs CUDA: no effect on cpu" in text
    assert "--record-memory-history / --memory-snapshot-path need CUDA (torch.cuda.memory): no effect on cpu" in text
    assert "--log-throughput: the throughputs are always logged here (e2e_tps, update_tps, vllm_tps" in text
    assert "--timing-log-option minmax: timing/* are the mean over the data-parallel ranks" in text
    assert "--timing-log-level 2:" in text
    assert "iterations 3 .. 5 are profiled" in text  # the window (Megatron-LM's: 3 .. 9) past --train-iters
    cuda = "\n".join(startup_lines(args.settings, "nccl"))
    assert "--profile: nsys's capture range (cudaProfilerStart / Stop) around iterations 3 .. 9 on ranks 0" in cuda
    assert "dumps it to snapshot.pickle every --log-interval" in cuda
    lone = "\n".join(startup_lines(parse_args(BASE + ["--use-pytorch-profiler"]).settings, "gloo"))
    assert "--use-pytorch-profiler without --profile profiles nothing" in lone
    plain = startup_lines(parse_args(BASE).settings, "gloo")
    assert not [line for line in plain if "profil" in line or "timing" in line]


def _settings(tmp_path, start=1, end=3, ranks=(0,), **kw):  # iterations 2 .. 3 as logged
    return ProfileSettings(profile=True, use_pytorch_profiler=True, profile_step_start=start, profile_step_end=end,
                           profile_ranks=ranks, trace_dir=str(tmp_path / "profile"), **kw)


def _fake_loop(profiler, first, last):
    """Iterations first..last as the trainer drives them: phases timed by the stages' Timers, each iteration
    marked by a range of its own name."""
    for iteration in range(first, last + 1):
        profiler.begin(iteration)
        t = Timers()
        with torch.profiler.record_function(f"fake-iteration-{iteration}"), t("all"):
            with t("rollout"):
                torch.randn(16, 16) @ torch.randn(16, 16)
            with t("update"):
                torch.randn(8, 8).sum()
        t.pop()
        profiler.end(iteration)
    profiler.close()


def _trace_names(path):
    with open(path) as f:
        trace = json.load(f)
    return {event.get("name") for event in trace["traceEvents"]}


@pytest.mark.parametrize("first,last,recorded", [
    (1, 5, [2, 3]),  # the window: start 1, end 3 (Megatron-LM's: iterations 2 .. 3)
    (3, 5, [3]),  # resumed inside it: the rest of it
    (1, 2, [2]),  # the run ends inside it: written at the end
])
def test_the_trace_holds_exactly_the_windows_iterations_with_the_phases(tmp_path, first, last, recorded):
    profiler = profiling.Profiler(_settings(tmp_path), rank=0, world_size=1, kind="cpu")
    _fake_loop(profiler, first, last)
    files = glob.glob(str(tmp_path / "profile" / "rank0.*.pt.trace.json"))
    assert len(files) == 1 and profiler.traces == files and profiler.profiled == recorded
    names = _trace_names(files[0])
    assert {f"fake-iteration-{i}" for i in range(first, last + 1)} & names == {f"fake-iteration-{i}" for i in recorded}
    assert {"timing/all", "timing/rollout", "timing/update"} <= names
    assert timers._PHASE_RANGES is None  # the ranges stop with the window
    assert any("rank0" in line for line in profiler.summary_lines())


def test_a_rank_not_chosen_writes_nothing(tmp_path):
    profiler = profiling.Profiler(_settings(tmp_path, ranks=(1,)), rank=0, world_size=2, kind="cpu")
    _fake_loop(profiler, 1, 5)
    assert not (tmp_path / "profile").exists() and profiler.profiled == []


def test_nsys_range_and_memory_snapshot_on_cuda(tmp_path, monkeypatch):
    """--profile alone on CUDA: cudaProfilerStart before the window's first iteration, Stop after its last, NVTX
    ranges for the phases; --record-memory-history: the last rank dumps every --log-interval and at the end.
    (Stand-ins for the CUDA calls: this machine has none.)"""
    calls = []
    monkeypatch.setattr(profiling.device, "cuda_profiler_range", lambda start: calls.append(("range", start)))
    monkeypatch.setattr(profiling.device, "record_memory_history", lambda on: calls.append(("history", on)))
    monkeypatch.setattr(profiling.device, "dump_memory_snapshot", lambda path: calls.append(("dump", path)))
    monkeypatch.setattr(profiling.torch.autograd.profiler, "emit_nvtx", lambda **kw: torch.autograd.profiler.record_function("nvtx"))
    ranges = []

    class Range:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            ranges.append(self.name)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(profiling, "_nvtx_range", Range)
    settings = ProfileSettings(profile=True, profile_step_start=1, profile_step_end=3, record_memory_history=True,
                               memory_snapshot_path=str(tmp_path / "m.pickle"), log_interval=2)
    profiler = profiling.Profiler(settings, rank=0, world_size=1, kind="cuda")
    for iteration in range(1, 6):
        calls.append(("begin", iteration))
        profiler.begin(iteration)
        with Timers()("rollout"):
            pass
        profiler.end(iteration)
    profiler.close()
    profiler.close()  # idempotent (the trainer's finally)
    dump = ("dump", str(tmp_path / "m.pickle"))
    assert calls == [("history", True), ("begin", 1), ("begin", 2), ("range", True), dump, ("begin", 3),
                     ("range", False), ("begin", 4), dump, ("begin", 5), dump, ("history", False)]
    assert ranges == ["timing/rollout", "timing/rollout"] and profiler.profiled == [2, 3]


def test_the_progress_line_and_the_summary():
    now = [100.0]
    progress = Progress(total_iterations=10, start_iteration=2, clock=lambda: now[0])
    lines = []
    logger = MetricsLogger(log_interval=2, total_iterations=10, print_fn=lines.append, progress=progress,
                           on_stdout=timers.on_stdout(0))
    for iteration, score, seconds in ((3, None, 2.5), (4, 0.5, 2.5), (5, None, 4.0), (6, 0.25, 4.0)):
        now[0] += seconds
        metrics = {"timing/all": 2.5, "timing/rollout": 1.0, "e2e_tps": 3.0}
        if score is not None:  # the unnamed set and a named one (not its data source's)
            metrics.update({"eval/score/mean": score, "eval/gsm8k/score/mean": 1 - score,
                            "eval/gsm8k/left/score/mean": 0.0})
        logger.log(iteration, metrics)
    assert len(lines) == 2
    # iterations 3 and 4 took 5 s: 2500 ms each; 6 of 10 iterations left at that pace: 0:00:15
    assert lines[0].startswith(" iteration   4/ 10 | elapsed time per iteration (ms): 2500.0 | elapsed: 0:00:05 | "
                               "time left: 0:00:15 | timing/all:")
    assert "timing/rollout" not in lines[0] and "e2e_tps" in lines[0]  # --timing-log-level 0
    # 5 and 6 took 8 s: the mean since the previous line; 13 s for 4 iterations, 4 left: 0:00:13
    assert lines[1].startswith(" iteration   6/ 10 | elapsed time per iteration (ms): 4000.0 | elapsed: 0:00:13 | "
                               "time left: 0:00:13 |")
    summary = "\n".join(progress.summary_lines([("checkpoints", "/ck (last: iteration 6)"), ("TensorBoard", None)]))
    assert summary == ("run summary: iterations 3 .. 6 of 10 done in 0:00:13 (3.25 s per iteration)\n"
                       "  eval/score/mean: best 0.5000 (iteration 4), last 0.2500 (iteration 6)\n"
                       "  eval/gsm8k/score/mean: best 0.7500 (iteration 6), last 0.7500 (iteration 6)\n"
                       "  checkpoints: /ck (last: iteration 6)")
    every = MetricsLogger(total_iterations=1, print_fn=lines.append, on_stdout=timers.on_stdout(1))
    every.log(1, {"timing/rollout": 1.0})
    assert "timing/rollout" in lines[-1]


def test_the_window_is_megatrons_and_an_empty_one_says_the_flags_the_range_and_the_fix():
    # Megatron-LM's 0 1: the window opens before the first iteration and closes after it
    first = parse_args(BASE + ["--profile", "--profile-step-start", "0", "--profile-step-end", "1"])
    assert "--profile: nsys's capture range (cudaProfilerStart / Stop) around iterations 1 .. 1 on ranks 0" in \
        "\n".join(startup_lines(first.settings, "nccl"))
    with pytest.raises(ArgumentError) as err:
        parse_args(BASE + ["--profile", "--profile-step-start", "3", "--profile-step-end", "3"])
    assert str(err.value) == (
        "--profile-step-start 3 --profile-step-end 3 profiles no iteration: give 0 <= --profile-step-start < "
        "--profile-step-end <= --train-iters (5); the profiled iterations are start + 1 .. end as logged "
        "(Megatron-LM's: the window opens once start iterations are done and closes once end are), e.g. "
        "--profile-step-start 3 --profile-step-end 4 for iteration 4 alone")
    with pytest.raises(ArgumentError, match="--profile-with-memory has no effect without --profile"):
        parse_args(BASE + ["--profile-with-memory"])


def test_a_run_resumed_past_its_window_says_so_and_announces_no_trace(tmp_path):
    profiler = profiling.Profiler(_settings(tmp_path), rank=0, world_size=1, kind="cpu")  # window 2 .. 3
    line = profiler.resumed(3)
    assert line == ("--profile: this run resumes after iteration 3, past the profiled window (iterations 2 .. 3): "
                    "nothing is profiled and no trace is written; give --profile-step-start 3 or more (and a later "
                    "--profile-step-end) to profile this run")
    _fake_loop(profiler, 4, 5)
    assert not (tmp_path / "profile").exists()
    assert profiler.summary_lines() == ["profiler: no trace (the run resumed after iteration 3, past the window 2 .. 3)"]
    inside = profiling.Profiler(_settings(tmp_path), rank=0, world_size=1, kind="cpu")
    assert inside.resumed(2) is None  # iteration 3 is still in the window: profiled


def _recorded(path):
    """What a trace holds beyond the ops' times: shapes (the ops' "Input Dims"), Python stacks ("python_function"
    events), allocations (instant events with "Bytes")."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return {what for what, found in (
        ("shapes", any("Input Dims" in e.get("args", {}) for e in events)),
        ("stacks", any(e.get("cat") == "python_function" for e in events)),
        ("memory", any("Bytes" in e.get("args", {}) for e in events))) if found}


def test_a_trace_records_stacks_shapes_and_memory_only_when_asked(tmp_path):
    lean = profiling.Profiler(_settings(tmp_path / "lean"), rank=0, world_size=1, kind="cpu")
    _fake_loop(lean, 1, 3)
    full = profiling.Profiler(_settings(tmp_path / "full", pytorch_profiler_collect_shapes=True,
                                        pytorch_profiler_collect_callstack=True, profile_with_memory=True),
                              rank=0, world_size=1, kind="cpu")
    _fake_loop(full, 1, 3)
    (lean_file,), (full_file,) = lean.traces, full.traces
    assert _recorded(lean_file) == set() and _recorded(full_file) == {"shapes", "stacks", "memory"}
    assert os.path.getsize(lean_file) < os.path.getsize(full_file) / 2
    args = parse_args(BASE + ["--profile", "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end",
                              "3", "--save", "s", "--profile-with-stack", "--profile-record-shapes"])
    assert (args.settings.profile.pytorch_profiler_collect_callstack,
            args.settings.profile.pytorch_profiler_collect_shapes, args.settings.profile.profile_with_memory) == \
        (True, True, False)  # MindSpeed's names for Megatron-LM's flags
    assert "with the ops' shapes, call stacks" in "\n".join(startup_lines(args.settings, "gloo"))
