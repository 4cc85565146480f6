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
            "--profile", "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "4",
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
