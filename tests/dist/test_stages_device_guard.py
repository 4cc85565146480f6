"""Both stages under the virtual-device guard (`device_guard.py`): a full iteration never mixes host and device
tensors, as a GPU run would demand, at TP1/PP1/DP1 (one process) and at TP2 and PP2 (two gloo processes).

Each run is the real entry point (`posttrain_gpt.main`) on the tiny word task, with the features that move
tensors around: `--offload-ref-reward` (the reference and reward models wait in host memory), held-out
evaluation, a checkpoint save. A mix raises `DeviceMixError` inside the run, naming the op and the stack.

The guard bites: with the first bug seen on an H200 put back (`roles.load_model` no longer moves the model to
the accelerator), the first forward of generation fails, on the embedding lookup of device tokens into host
weights. (A run of the guard against the commit before the device fixes caught the other four as well: the
scorer's host total, the host advantages, the host pipeline broadcast buffer and the host metric reduction.)
"""

import os

import pytest

from tests.helpers.multiproc import run_distributed

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes


def _argv(task, stage, tp, pp, out):
    models = f"tp{tp}pp{pp}"
    argv = ["--stage", stage, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--ref-model", task[f"mg_actor_{models}"], "--reward-model", task[f"mg_reward_{models}"],
            "--tokenizer-name-or-path", task["tokenizer"], "--data-path", task["data"],
            "--eval-data-path", task["data"], "--eval-interval", "1", "--eval-samples", "2",
            "--global-batch-size", "2", "--micro-batch-size", "2", "--train-iters", "1", "--max-length", "24",
            "--max-new-tokens", "4", "--do-sample", "--seed", "5", "--lr", "1e-3", "--offload-ref-reward",
            "--save", str(out / f"{stage}_{models}")]
    if stage == "grpo":
        argv += ["--n-samples-per-prompt", "2", "--kl-coef", "0.01"]
    return argv


def _guarded_runs(rank, world_size, runs, unmoved_models=False):
    """posttrain_gpt.main on each argv inside `virtual_device()`; returns the exit codes."""
    os.environ["MINDSPEED_DEVICE"] = "cpu"
    from tests.helpers.device_guard import virtual_device
    from megatron.core import parallel_state

    import posttrain_gpt
    from mindspeed_llm.rl.update import roles

    codes = []
    with pytest.MonkeyPatch.context() as patch:  # put back after the runs: the next body may get these ranks
        if unmoved_models:  # the H200 bug: models built in host memory and never moved
            load = roles.load_model
            patch.setattr(roles, "load_model", lambda *args, **kwargs: load(*args, **kwargs).to("cpu"))
        for argv in runs:
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            with virtual_device():
                codes.append(posttrain_gpt.main(argv))
    return codes


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from tests.helpers import word_task

    return word_task.build(tmp_path_factory.mktemp("guard_task"), layouts=((1, 1), (2, 1), (1, 2)), reward=True)


def test_one_process_both_stages(task, tmp_path):
    runs = [_argv(task, stage, 1, 1, tmp_path) for stage in ("grpo", "trl_ppo")]
    assert run_distributed(_guarded_runs, 1, runs) == [[0, 0]]


def test_tp2_and_pp2_both_stages(task, tmp_path):
    runs = [_argv(task, stage, tp, pp, tmp_path) for tp, pp in ((2, 1), (1, 2)) for stage in ("grpo", "trl_ppo")]
    assert run_distributed(_guarded_runs, 2, runs) == [[0, 0, 0, 0]] * 2


def test_the_guard_catches_a_model_left_in_host_memory(task, tmp_path):
    with pytest.raises(AssertionError) as failure:
        run_distributed(_guarded_runs, 1, [_argv(task, "grpo", 1, 1, tmp_path)], True)
    message = str(failure.value)
    assert "DeviceMixError" in message and "embedding" in message, message[-3000:]
