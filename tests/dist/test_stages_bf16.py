"""`--bf16` as Megatron users run it, on the CPU: bf16 weights, fp32 main weights and gradients in megatron's
optimizer, log-probs / KL / advantages / losses in fp32.

Both stages run 3 iterations on the tiny word task (`word_task.py`) in fp32 and in bf16, in one process. The
bf16 run replays the fp32 run's sampled responses (the same tokens; its own log-probs), so that the first
iteration of both sees the same data. Asserted:

* every logged loss of the 3 bf16 iterations is finite;
* the first iteration's losses and entropy are within 5% (relative, or 0.02 absolute for values near 0) of
  fp32's. Why 5%: bf16 keeps 8 significant bits, so each stored weight and activation is rounded by up to
  2^-9 = 0.2%; through two layers, the output layer and a log-softmax over 256 words the logits and values
  carry ~1% error, and the losses are sums of such terms. The same losses also differ from fp32's (bf16 really
  ran: a pure fp32 path would agree to 1e-6);
* every tensor that reaches the policy and value losses (log-probs, old / reference log-probs, advantages,
  values, returns, entropies) and the losses themselves are fp32;
* the saved actor holds bf16 weights (norms included, as Megatron-LM's Float16Module makes them), and
  megatron's optimizer keeps fp32 main copies of them.
"""

import math

import pytest
import torch

from tests.helpers.multiproc import run_distributed

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

ITERS = 3
LOSSES = {"grpo": ["actor/pg_loss", "actor/kl_loss", "actor/entropy"],
          "trl_ppo": ["actor/pg_loss", "actor/abs_pg_loss", "actor/entropy", "critic/vf_loss"]}


def _argv(task, stage, out, bf16):
    argv = ["--stage", stage, "--ref-model", task["mg_actor_tp1pp1"], "--tokenizer-name-or-path", task["tokenizer"],
            "--data-path", task["data"], "--global-batch-size", "4", "--micro-batch-size", "2",
            "--train-iters", str(ITERS), "--max-length", "24", "--max-new-tokens", "6", "--do-sample", "--seed", "3",
            "--lr", "1e-3", "--metrics-jsonl", str(out / "metrics.jsonl"), "--save", str(out / "save")]
    if stage == "grpo":
        argv += ["--n-samples-per-prompt", "2", "--reward-model", task["mg_reward_tp1pp1"], "--kl-coef", "0.05",
                 "--ppo-mini-batch-size", "4"]
    else:
        argv += ["--reward-model", task["mg_reward_tp1pp1"]]
    return argv + (["--bf16"] if bf16 else [])


def _runs(rank, world_size, runs):
    """Each stage in fp32, then in bf16 on the fp32 run's responses (tokens only)."""
    from dataclasses import replace

    from megatron.core import parallel_state

    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.rl import core_algos, trainer
    from mindspeed_llm.rl.rollouts import plain as rollout

    generate = rollout.generate
    recorded = {}
    dtypes = set()  # of every tensor the losses take and give, in the bf16 runs
    losses = {name: getattr(core_algos, name) for name in ("policy_loss", "value_loss")}

    def dtype_recording(fn):
        def loss(*args, **kwargs):
            out, metrics = fn(*args, **kwargs)
            if bf16_run:
                tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
                dtypes.update(t.dtype for t in tensors + [out] + list(metrics.values()) if t.is_floating_point())
            return out, metrics
        return loss

    def recording(model, prompts, sampling, *, iteration=0, **kwargs):
        result = generate(model, prompts, sampling, iteration=iteration, **kwargs)
        recorded[iteration] = replace(result, log_probs=None)
        return result

    def replaying(model, prompts, sampling, *, iteration=0, **kwargs):
        return recorded[iteration]

    with pytest.MonkeyPatch.context() as patch:  # put back after the runs: the next body may get these ranks
        for name, fn in losses.items():
            patch.setattr(core_algos, name, dtype_recording(fn))
        for fp32_argv, bf16_argv in runs:
            for bf16_run, (argv, fake) in enumerate(((fp32_argv, recording), (bf16_argv, replaying))):
                if parallel_state.model_parallel_is_initialized():
                    parallel_state.destroy_model_parallel()
                patch.setattr(rollout, "generate", fake)
                trainer.run(parse_args(argv, world_size))
    return sorted(str(d) for d in dtypes)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.helpers import word_task

    root = tmp_path_factory.mktemp("bf16")
    task = word_task.build(root / "task", reward=True)
    dirs = {(stage, bf16): root / f"{stage}_{'bf16' if bf16 else 'fp32'}" for stage in LOSSES for bf16 in (0, 1)}
    (dtypes,) = run_distributed(_runs, 1, [(_argv(task, s, dirs[(s, 0)], False), _argv(task, s, dirs[(s, 1)], True))
                                           for s in LOSSES])
    return dirs, dtypes


def _metrics(out):
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("stage", list(LOSSES))
def test_bf16_trains_and_first_losses_are_close_to_fp32(runs, stage):
    dirs, _ = runs
    fp32, bf16 = _metrics(dirs[(stage, 0)]), _metrics(dirs[(stage, 1)])
    assert [m["iteration"] for m in bf16] == list(range(1, ITERS + 1))
    for m in bf16:
        assert all(math.isfinite(m[key]) for key in LOSSES[stage]), m
    first, reference = bf16[0], fp32[0]
    assert first["response_length/mean"] == reference["response_length/mean"]  # the same responses
    differs = False
    for key in LOSSES[stage]:
        a, b = first[key], reference[key]
        assert abs(a - b) <= max(0.05 * abs(b), 0.02), f"{key}: bf16 {a} vs fp32 {b}"
        differs |= abs(a - b) > 1e-6
    assert differs, "bf16 and fp32 agree to 1e-6: the bf16 run did not compute in bf16"


def test_the_rl_math_runs_in_fp32(runs):
    """Log-probs, old / reference log-probs, advantages, values, returns and the losses all reach the losses in
    fp32 in the bf16 runs (the logits and values are upcast before any RL math)."""
    _, dtypes = runs
    assert dtypes == ["torch.float32"], dtypes


def test_bf16_checkpoint_holds_bf16_weights_and_fp32_main_copies(runs):
    from mindspeed_llm.checkpoint import load_shard

    dirs, _ = runs
    state = load_shard(str(dirs[("grpo", 1)] / "save" / "actor"), 0, 0, weights_only=False)
    weights = [t for k, t in state["model"].items() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    assert weights and all(t.dtype == torch.bfloat16 for t in weights)
    main = state["optimizer"]["fp32_from_fp16_params"]
    flat = [t for group in main for t in group]
    assert flat and all(t.dtype == torch.float32 for t in flat)
    fp32_state = load_shard(str(dirs[("grpo", 0)] / "save" / "actor"), 0, 0, weights_only=False)
    assert all(t.dtype == torch.float32 for t in fp32_state["model"].values() if isinstance(t, torch.Tensor)
               and t.is_floating_point())
