"""The stage runs of many layouts, shared by the end-to-end tests that compare them (layout invariance, LoRA, MoE,
RL methods, context parallelism, partial rollouts, DeepSeek-V3): the word task's argv per layout and case, the
runs themselves in one spawned process per world size (`run_cases`, `run_stages`: `trainer.run` on each argv,
with the `odd_first_word` verifier registered), and what the comparisons read (the merged saved weights, the
metrics row, the tolerances)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
SEED = 4
RTOL, ATOL = 1e-5, 1e-6  # metrics
# kl/mean sums, over a response's 8 tokens, logp - ref_logp of equal weights (the first iteration): pure rounding
# of log-probs of size ~5 (fp32: ~5e-7 each), which forward passes of other shapes round differently; up to ~4e-6
KEY_ATOL = {"kl/mean": 1e-5}
WEIGHT_RTOL = 1e-5  # per tensor, relative to its norm
# the rollout / training log-prob mismatch: rounding noise (~1e-6) that no tolerance relative to it can bound
SKIPPED = ("timing/", "e2e_tps", "update_tps", "vllm_tps", "rollout_tps", "world_size", "rollout_mismatch/")
# name -> (tp, pp, world size, micro-batch size of trl_ppo, of grpo)
LAYOUTS = {
    "mbs1": (1, 1, 1, 1, 1),
    "mbs4": (1, 1, 1, 4, 4),
    "tp2": (2, 1, 2, 4, 4),
    "pp2": (1, 2, 2, 2, 2),
    "dp2": (1, 1, 2, 2, 4),
    # token-budget micro-batches (--max-tokens-per-micro-batch): rows, packed prompt groups (grpo and trl_ppo_n2 at
    # micro-batch size 2), and DP2, whose ranks agree on their micro-batch counts
    "budget": (1, 1, 1, 1, 1),
    "budget_packed": (1, 1, 1, 2, 2),
    "dp2_budget": (1, 1, 2, 1, 2),
    # sequence parallelism (TP2) and context parallelism (CP2: DP1 x CP2, each rank half of every sequence in the
    # load-balanced order; grpo and trl_ppo_n2 at micro-batch size 4 pack their prompt groups), token budgets at CP2,
    # and CP2 x TP2 with sequence parallelism on 4 processes
    "tp2_sp": (2, 1, 2, 4, 4),
    "cp2": (1, 1, 2, 4, 4),
    "cp2_budget": (1, 1, 2, 1, 2),
    "cp2_tp2_sp": (2, 1, 4, 4, 4),
}
LAYOUT_FLAGS = {"tp2_sp": ["--sequence-parallel"], "cp2": ["--context-parallel-size", "2"],
                "cp2_budget": ["--context-parallel-size", "2"],
                "cp2_tp2_sp": ["--context-parallel-size", "2", "--sequence-parallel"]}
# layout -> (update budget, forward-pass budget). Prompts are 3-5 tokens and responses 8 (the tiny model never
# stops early): rows of 11-13 tokens and packed pairs of 19-21, under --max-prompt-length 5 (which the budgets must
# hold: 13 and 21), so micro-batches hold 1-3 rows or 1-2 groups
BUDGETS = {"budget": (26, 39), "budget_packed": (42, 63), "dp2_budget": (26, 26),
           # per rank: a CP2 micro-batch holds twice as many tokens, half of them on each rank
           "cp2_budget": (13, 20)}
# the generation engine's limits (speed and memory only) on two of the layouts
ROLLOUT_LIMITS = {"pp2": ["--rollout-max-num-seqs", "3", "--rollout-max-num-batched-tokens", "8"],
                  "dp2": ["--rollout-max-num-seqs", "2"]}


def odd_first_word(text, label):
    """A coin-flip rule reward: 1 when the response's first word is an odd `wN` (some groups of 2 agree)."""
    words = text.split()
    return float(bool(words) and words[0][1:].isdigit() and int(words[0][1:]) % 2 == 1)


def register_odd_first_word():
    """Registers `odd_first_word` as the verifier of that name (`--verifier-function odd_first_word`) in this
    process: the runs call it before `trainer.run`."""
    from mindspeed_llm.rl.verifiers import register_verifier

    register_verifier("odd_first_word", override=True)(odd_first_word)


def update_cases():
    """{case name: (stage, extra argv)}."""
    cases = {"trl_ppo": ("trl_ppo", ["--global-batch-size", "8", "--ppo-mini-batch-size", "4", "--whiten-rewards",
                                     "--kl-coef", "0.05", "--lr", "0.2"]),
             # two samples per prompt: groups packed with their prompt computed once at mbs 4, GAE per sample
             "trl_ppo_n2": ("trl_ppo", ["--global-batch-size", "4", "--n-samples-per-prompt", "2",
                                        "--ppo-mini-batch-size", "4", "--kl-coef", "0.05", "--lr", "0.2"])}
    for mode in AGG_MODES:
        extra = ["--global-batch-size", "8", "--n-samples-per-prompt", "2", "--ppo-mini-batch-size", "8",
                 "--filter-groups", "--verifier-function", "odd_first_word", "--loss-agg-mode", mode,
                 "--kl-coef", "0.05", "--entropy-coeff", "0.01", "--lr", "0.5"]
        if mode == "token-mean":
            extra += ["--adv-scale", "batch"]
        cases[f"grpo_{mode}"] = ("grpo", extra)
    # DAPO's dynamic sampling: more generation batches until 8 groups with reward spread; ranks exchange them
    cases["grpo_dynamic_sampling"] = ("grpo", [
        "--global-batch-size", "8", "--n-samples-per-prompt", "2", "--ppo-mini-batch-size", "8", "--dynamic-sampling",
        "--max-num-gen-batches", "8", "--verifier-function", "odd_first_word", "--kl-coef", "0.05", "--lr", "0.5"])
    cases.update(distill_cases())
    return cases


# `--teacher-load` in a case's argv: `layout_argv` puts the teacher of the run's layout there
TEACHER = "<teacher of the layout>"


def distill_cases():
    """{case name: (stage, extra argv)} of on-policy distillation from the word task's teacher (`word_task.build(
    teacher=True)`: another size, the same vocabulary): k3 as a loss beside a verifier's rewards; the top-k forward
    KL (k 8 of 256 words: under TP2 the top-k of vocab-parallel logits) as the only signal (pure distillation, no
    verifier); k1 as a per-token reward, in grpo and in trl_ppo beside the reward model."""
    grpo = ["--global-batch-size", "8", "--n-samples-per-prompt", "2", "--ppo-mini-batch-size", "8",
            "--kl-coef", "0.05", "--lr", "0.5", "--teacher-load", TEACHER]
    return {
        "grpo_distill_k3_loss": ("grpo", grpo + ["--verifier-function", "odd_first_word", "--distill-loss", "k3",
                                                 "--distill-mode", "loss", "--distill-coef", "0.5"]),
        "grpo_distill_topk": ("grpo", grpo + ["--distill-loss", "topk_forward_kl", "--distill-mode", "loss",
                                              "--distill-topk", "8"]),
        "grpo_distill_k1_reward": ("grpo", grpo + ["--verifier-function", "odd_first_word", "--distill-loss", "k1",
                                                   "--distill-mode", "reward", "--distill-coef", "0.5"]),
        "trl_ppo_distill_k1": ("trl_ppo", ["--global-batch-size", "8", "--ppo-mini-batch-size", "4", "--kl-coef",
                                           "0.05", "--lr", "0.2", "--teacher-load", TEACHER, "--distill-loss", "k1",
                                           "--distill-coef", "0.1"]),
    }


def layout_argv(paths, stage, layout, extra, out: Path):
    tp, pp, _, mbs_ppo, mbs_grpo = LAYOUTS[layout]
    models = f"tp{tp}pp{pp}"
    argv = [
        "--stage", stage, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--micro-batch-size", str(mbs_ppo if stage == "trl_ppo" else mbs_grpo), "--train-iters", "1",
        "--seed", str(SEED), "--data-path", paths["data"], "--tokenizer-name-or-path", paths["tokenizer"],
        "--max-length", "64", "--max-new-tokens", "8", "--do-sample", "--temperature", "1.0",
        "--ref-model", paths[f"mg_actor_{models}"], "--optimizer", "sgd", "--sgd-momentum", "0",
        "--clip-grad", "1.0", "--ppo-epochs", "1", "--log-interval", "1",
        "--metrics-jsonl", str(out / "metrics.jsonl"), "--save", str(out / "save"), "--save-interval", "1",
    ]
    if stage == "trl_ppo":
        argv += ["--reward-model", paths[f"mg_reward_{models}"]]
    if layout in BUDGETS:
        update, forward = BUDGETS[layout]
        argv += ["--max-tokens-per-micro-batch", str(update), "--forward-max-tokens-per-micro-batch", str(forward),
                 "--max-prompt-length", "5"]
    extra = [paths[f"mg_teacher_{models}"] if value == TEACHER else value for value in extra]
    return argv + LAYOUT_FLAGS.get(layout, []) + ROLLOUT_LIMITS.get(layout, []) + extra


def run_cases(rank, world_size, runs):
    """Every case of one layout in this process: megatron's parallel state is rebuilt for each run. Returns, per
    grpo run, (rows the group filter took out of the loss, how many of those still have their response)."""
    from megatron.core import parallel_state

    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.rl import trainer
    from mindspeed_llm.rl.update.batch_plan import MicroBatchPlan
    from mindspeed_llm.rl.stages import grpo

    register_odd_first_word()
    filtered, update, running = [], grpo.ppo_update, {}

    def recording_update(model, exp, plan, schedule, *rest, **kwargs):
        if running["args"].filter_groups:
            out = exp.loss_mask.sum(-1) == 0
            filtered.append((int(out.sum()), int((out & (exp.response_mask.sum(-1) > 0)).sum())))
        return update(model, exp, plan, schedule, *rest, **kwargs)

    # the samples per micro-batch of every update step cut by a token budget
    budget_steps, micro_batches = [], MicroBatchPlan.micro_batches

    def recording_micro_batches(self, exp, samples=None, update=False):
        out = micro_batches(self, exp, samples, update)
        if update and self.max_tokens is not None:
            budget_steps.append([mb["responses"].shape[0] for mb in out])
        return out

    with pytest.MonkeyPatch.context() as patch:  # put back after the runs: the next body may get these ranks
        patch.setattr(grpo, "ppo_update", recording_update)
        patch.setattr(MicroBatchPlan, "micro_batches", recording_micro_batches)
        for argv in runs:
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            running["args"] = parse_args(argv, world_size)
            trainer.run(running["args"])
    return filtered, budget_steps


def full_weights(root: Path, role: str):
    """The saved `role` of a stage run as one full (TP/PP merged) state dict."""
    from mindspeed_llm.checkpoint import checkpoint_info, load_shard, merge_model

    info = checkpoint_info(str(root / role))
    shards = {(t, p): load_shard(str(root / role), t, p)["model"] for t in range(info["tp"]) for p in range(info["pp"])}
    full = merge_model(shards, info["spec"], info["tp"], info["pp"], info["value_head"])
    return {k: v.float() for k, v in full.items() if not k.endswith("_extra_state")}


def metrics_row(path: Path, skipped=SKIPPED):
    """The run's one metrics row, without the `skipped` keys (by default those no tolerance compares)."""
    (record,) = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    return {k: v for k, v in record.items() if not k.startswith(skipped)}


def relative(a, b):
    scale = float(b.norm())
    return float((a - b).norm()) / scale if scale else float(a.norm())


def run_stages(rank, world_size, runs):
    """`trainer.run` on each argv in this process (megatron's parallel state rebuilt for each), with the
    `odd_first_word` verifier registered."""
    from megatron.core import parallel_state

    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.rl import trainer

    register_odd_first_word()
    for argv in runs:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        trainer.run(parse_args(argv, world_size))
