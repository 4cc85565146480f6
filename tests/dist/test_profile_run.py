"""One tiny trl_ppo run on 1 process with Megatron-LM's profiling flags (`rl/profiling.py`): the trace of iterations
2 .. 3 is written under --tensorboard-dir/profile, parses as JSON and holds the phases of an iteration as named
ranges; the stdout lines carry the progress items and the run ends with its summary."""

import glob
import json

import pytest

from tests.helpers.multiproc import posttrain_in_process

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_ranks")]  # see pytest.ini


def test_a_profiled_run(tmp_path):
    from tests.helpers import word_task

    task = word_task.build(tmp_path / "task", reward=True)
    out = tmp_path / "run"
    argv = ["--stage", "trl_ppo", "--ref-model", task["mg_actor_tp1pp1"], "--reward-model", task["mg_reward_tp1pp1"],
            "--tokenizer-name-or-path", task["tokenizer"], "--data-path", task["data"], "--global-batch-size", "2",
            "--micro-batch-size", "2", "--train-iters", "4", "--max-length", "24", "--max-new-tokens", "4",
            "--do-sample", "--seed", "5", "--lr", "1e-3", "--metrics-jsonl", str(out / "metrics.jsonl"),
            "--tensorboard-dir", str(out / "tb"), "--save", str(out / "ckpt"),
            "--profile", "--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "3",
            "--pytorch-profiler-collect-callstack",  # the stacks make TensorBoard's Module view
            "--record-memory-history", "--log-throughput"]
    (code, stdout, stderr), = posttrain_in_process([argv])
    assert code == 0, stderr[-3000:]
    files = glob.glob(str(out / "tb" / "profile" / "rank0.*.pt.trace.json"))
    assert len(files) == 1
    with open(files[0]) as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    assert {"timing/all", "timing/rollout", "timing/old_log_p", "timing/reference_model", "timing/critic_model",
            "timing/adv", "timing/update", "timing/update_critic", "timing/reward_model"} <= names
    assert sum(name.startswith("ProfilerStep#") for name in names) == 2  # iterations 2 and 3
    assert "--record-memory-history / --memory-snapshot-path need CUDA" in stdout
    assert "--log-throughput: the throughputs are always logged here" in stdout
    assert "elapsed time per iteration (ms):" in stdout and "time left:" in stdout
    assert "run summary: iterations 1 .. 4 of 4 done in" in stdout
    assert f"checkpoints: {out / 'ckpt'} (last: iteration 4)" in stdout
    assert f"profiler traces: {out / 'tb' / 'profile'}" in stdout
    # TensorBoard's profiler tab (torch-tb-profiler) reads it: its own loader finds rank 0's profile with its views,
    # the operators and the two profiled iterations as steps
    assert _tensorboard_profile(out / "tb" / "profile") == {
        "workers": ["rank0"], "views": ["Overview", "Operator", "Trace", "Module"], "steps": 2, "has_operators": True}


_TB_PROFILE = """
import json, sys
from torch_tb_profiler import io
from torch_tb_profiler.profiler.loader import RunLoader

if __name__ == "__main__":  # the loader parses each worker's file in a spawned process
    run = RunLoader("profile", sys.argv[1], io.Cache()).load()
    (worker, profile), = [(k[0], p) for k, p in run.profiles.items() if k[0] != "All"]
    print(json.dumps({"workers": [worker], "views": [v.display_name for v in profile.views],
                      "steps": len(profile.overview["steps"]["rows"]),
                      "has_operators": bool(profile.operation_table_by_name["data"])}))
"""


def _tensorboard_profile(trace_dir):
    """What torch-tb-profiler's loader (TensorBoard's PYTORCH_PROFILER tab) makes of the traces in `trace_dir`."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _TB_PROFILE, str(trace_dir)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
