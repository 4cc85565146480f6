"""A learning test for `--stage grpo`: on a toy task a tiny random model's reward rises, deterministically.

Task: a tiny random Qwen2 (2 layers, hidden 64, `tests/helpers/hf_tiny.py`) with a 256-word vocabulary (`w4`..`w255`
plus `<pad> <s> </s> <unk>`, `hf_tiny.write_tokenizer`), converted with `convert_hf_to_mg`, continues prompts of 3..5
random words (preprocessed with `--prompt-type empty`). A verifier registered in the worker,
`toy_low_words`, scores a response by the fraction of its words in `w4`..`w67` (a quarter of the vocabulary; an empty
response scores 0). Random sampling hits those words often enough (initial mean ~0.3) to give every group of 8
samples a spread, and the policy can learn to prefer them from the prompt-independent part of the output layer.

The real stage runs in-process (one gloo process, `mindspeed_llm.rl.trainer.run`): sampled rollouts (temperature
1, 8 new tokens), rule rewards, group advantages, old / reference log-probs, clipped loss + k3 KL loss
(kl_coef 0.001), one Adam step per iteration (lr 5e-3), 30 iterations of 4 prompts x 8 samples, metrics in a JSONL.

Asserted:
* learning: the mean score of the last 5 iterations exceeds that of the first 5 by at least 0.3 (measured: ~0.3 ->
  ~0.98), and the trend is monotone up to noise: every 5-iteration block mean is at least the previous one minus 0.05;
* the signal is real: groups do have spread at the start (some non-zero advantages), the policy loss is finite;
* determinism: a second run with the same seed in the same process (the stage is cheap: ~4 s of training) gives the
  same score curve and the same losses, bit for bit;
* on-policy shortcut: one iteration with the old log-probs from a pass of their own (forced) logs the same losses
  and gradient norm as the run that takes them from the update's forward; the pass really ran (the policy
  log-prob pass is called for the old log-probs as well as for the reference), and the shortcut run made none.
"""

import json
import math
from pathlib import Path

import pytest

from tests.helpers.multiproc import run_distributed  # noqa: E402

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes

TARGET_WORDS = frozenset(f"w{i}" for i in range(4, 68))
ITERS = 30
SEED = 7


def toy_low_words(text, label):
    """Fraction of the response's words that are in TARGET_WORDS (0 for an empty response)."""
    words = text.split()
    return sum(w in TARGET_WORDS for w in words) / len(words) if words else 0.0


def _build_task(root: Path):
    """Tiny HF model -> Megatron checkpoint, a word-level tokenizer, and preprocessed word prompts."""
    from tests.helpers import word_task

    paths = word_task.build(root)
    return paths["tokenizer"], paths["mg_actor_tp1pp1"], paths["data"]


def _argv(tokenizer, model, data, metrics):
    return [
        "--stage", "grpo", "--train-iters", str(ITERS), "--seed", str(SEED),
        "--ref-model", model, "--tokenizer-name-or-path", tokenizer, "--data-path", data,
        "--global-batch-size", "4", "--n-samples-per-prompt", "8", "--micro-batch-size", "16",
        "--ppo-mini-batch-size", "32", "--ppo-epochs", "1",
        "--lr", "5e-3", "--clip-grad", "1.0", "--kl-coef", "0.001",
        "--max-length", "32", "--max-new-tokens", "8", "--do-sample", "--temperature", "1.0",
        "--verifier-function", "toy_low_words", "--log-interval", "1000", "--metrics-jsonl", metrics,
    ]


def _grpo_runs(rank, world_size, argv_a, argv_b, argv_with_pass):
    """Two identical runs of the real stage in this process (the second checks determinism), then one whose
    old log-probs come from a forward pass of their own instead of the update's (what it does off-policy)."""
    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.rl import trainer
    from mindspeed_llm.rl.verifiers import register_verifier
    from mindspeed_llm.rl.stages import grpo

    register_verifier("toy_low_words")(toy_low_words)
    passes = []  # the policy log-prob passes of each run: model chunks are trained (actor) or frozen (reference)
    counting = grpo.policy_logprobs

    def counted(model, *args, **kwargs):
        passes[-1].append("actor" if any(p.requires_grad for p in model[0].parameters()) else "reference")
        return counting(model, *args, **kwargs)

    grpo.policy_logprobs = counted
    for argv in (argv_a, argv_b):
        passes.append([])
        trainer.run(parse_args(argv, world_size))
    on_policy = grpo.old_logp_is_current
    grpo.old_logp_is_current = lambda args, exp: False
    try:
        passes.append([])
        trainer.run(parse_args(argv_with_pass, world_size))
    finally:
        grpo.old_logp_is_current = on_policy
        grpo.policy_logprobs = counting
    return passes


def _read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_grpo_reward_rises_on_toy_task(tmp_path):
    tokenizer, model, data = _build_task(tmp_path)
    first, second, with_pass = tmp_path / "run_a.jsonl", tmp_path / "run_b.jsonl", tmp_path / "run_pass.jsonl"
    argv_pass = _argv(tokenizer, model, data, str(with_pass))
    argv_pass[argv_pass.index("--train-iters") + 1] = "1"
    (passes,) = run_distributed(_grpo_runs, 1, _argv(tokenizer, model, data, str(first)),
                                _argv(tokenizer, model, data, str(second)), argv_pass)
    run = _read(first)
    assert [m["iteration"] for m in run] == list(range(1, ITERS + 1))
    scores = [m["grpo/score/mean"] for m in run]
    print("score curve:", " ".join(f"{s:.2f}" for s in scores))

    # There is signal from the start: groups differ, so some advantages are non-zero.
    assert 0.1 < scores[0] < 0.6, scores[0]
    assert run[0]["grpo/advantages/max"] > 0.5 and run[0]["grpo/advantages/min"] < -0.5
    assert all(math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/kl_loss"]) for m in run)

    # Learning: a clear rise, and no block of 5 iterations falls back below the previous one (beyond noise).
    blocks = [sum(scores[i:i + 5]) / 5 for i in range(0, ITERS, 5)]
    assert blocks[-1] - blocks[0] >= 0.3, blocks
    assert all(b >= a - 0.05 for a, b in zip(blocks, blocks[1:])), blocks

    # Deterministic: the same seed gives the same run.
    again = _read(second)
    keys = ("grpo/score/mean", "grpo/score/min", "grpo/score/max", "actor/pg_loss", "actor/kl_loss",
            "actor/entropy", "grad_norm", "response_length/mean")
    assert [[m[k] for k in keys] for m in again] == [[m[k] for k in keys] for m in run]

    # One epoch of one mini-batch reads its old log-probs off the update's own forward (no pass); that equals
    # a pass of its own on the same weights: same rollout, losses and gradient norm up to float rounding.
    (passed,) = _read(with_pass)
    assert passes == [["reference"] * ITERS, ["reference"] * ITERS, ["actor", "reference"]]  # the pass really ran
    assert passed["grpo/score/mean"] == run[0]["grpo/score/mean"]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "grad_norm"):
        assert abs(passed[key] - run[0][key]) <= 1e-5 * max(1.0, abs(run[0][key])), (key, passed[key], run[0][key])
    # the separate pass's old log-probs equal the update's own: the ratio is 1 up to float rounding
    assert abs(passed["actor/ppo_kl"]) < 1e-6
