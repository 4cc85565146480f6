"""`--stage grpo`: Group Relative Policy Optimization.

One iteration: each prompt sampled `--n-samples-per-prompt` times -> rule verifiers and/or reward model ->
outcome advantages (`--adv-estimator`: group-normalised, or leave-one-out) -> old and reference log-probs -> clipped loss + KL loss (+ entropy bonus)
-> update. No critic. The reference starts from `--ref-model` (default: the initial actor) and is skipped
when `--kl-coef 0`.
"""

from __future__ import annotations

import functools
import os
from typing import Dict, Sequence

import torch

from mindspeed_llm import device
from mindspeed_llm.arguments import ArgumentError
from mindspeed_llm.distributed import sum_over_data_parallel
from mindspeed_llm.rl import core_algos, roles
from mindspeed_llm.rl.batch_plan import MicroBatchPlan
from mindspeed_llm.rl.evaluation import evaluate_policy
from mindspeed_llm.rl.losses import clipped_policy_loss
from mindspeed_llm.rl.metrics import Timers, mean_min_max, prefixed
from mindspeed_llm.rl.passes import policy_logprobs
from mindspeed_llm.rl.ppo_loop import old_logp_is_current, ppo_update
from mindspeed_llm.rl.rollout import rollout, rollout_metrics, sampling_config
from mindspeed_llm.rl.scoring import Scorer


# The actor's logged losses (`core_algos`' names; `actor/lr` and the bare `grad_norm` follow, as MindSpeed-RL logs).
ACTOR_METRICS = ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss")


class GRPOStage:
    name = "grpo"
    log_lines = {"actor": ["actor/", "grad_norm"], "reward": ["grpo/"], "timing": ["timing/"]}

    def __init__(self, args, tokenizer):
        self.args = args
        self.tokenizer = tokenizer
        self.advantages = _advantage_estimator(args)
        if not args.ref_model and os.path.isdir(os.path.join(args.load, "actor")):
            raise ArgumentError(
                f"--load {args.load} is a grpo --save directory: pass --ref-model with the original weights too "
                "(the reference model always comes from them; the actor resumes from --load)"
            )
        initial = args.ref_model or args.load
        flag = "--ref-model" if args.ref_model else "--load"
        self.actor = roles.trainable(roles.load_model(initial, flag, args), args, "actor")
        self.reference = roles.offloaded(roles.frozen(roles.load_model(initial, flag, args)),
                                         args.offload_ref_reward) if args.kl_coef > 0 else None
        reward_model = roles.load_reward_model(args) if args.reward_model else None
        roles.check_vocab({"actor": self.actor.module, "reference": self.reference, "reward": reward_model},
                          tokenizer)
        self.scorer = Scorer.from_args(args, reward_model)
        self.sampling = sampling_config(args, tokenizer)

    def roles(self):
        return {"actor": self.actor}

    def evaluate(self, rows: Sequence[dict]) -> Dict[str, float]:
        return evaluate_policy(self.actor, self.reference, self.scorer, self.tokenizer, rows, self.args,
                               self.args.offload_ref_reward)

    # ------------------------------------------------------------------ one iteration
    def iteration(self, iteration: int, rows: Sequence[dict]) -> Dict[str, float]:
        args, n = self.args, self.args.n_samples_per_prompt
        timers = Timers(sync=device.synchronize)
        with timers("all"):
            with timers("rollout"):  # a prompt's n samples are consecutive rows
                exp = rollout(self.actor.module, rows, self.sampling, iteration, self.tokenizer,
                              samples_per_prompt=n)
            # every pass and the update compute a prompt once per group, when micro-batches hold whole groups
            plan = MicroBatchPlan.build(exp, args.micro_batch_size, group_size=n)
            rollout_stats = rollout_metrics(exp)
            exp.scores, score_metrics = self.scorer(exp, plan, timers)

            with timers("adv"):
                advantages = self.advantages(exp.scores, n, sum_across=sum_over_data_parallel)
                exp.advantages = advantages[:, None] * exp.response_mask
                if args.filter_groups:
                    # Groups whose samples all scored the same carry no signal; their tokens leave the loss
                    # (its mask, so shapes and step counts stay equal on every rank; no refill).
                    informative = exp.scores.view(-1, n).std(dim=1, unbiased=False) > 0
                    exp.loss_mask = exp.response_mask * informative.repeat_interleave(n)[:, None]
            with timers("old_log_p"):  # ~0 s when the update's own log-probs are the old ones
                if not old_logp_is_current(args, exp):
                    exp.old_logp = policy_logprobs(self.actor.chunks, exp, plan, args.temperature)
            if self.reference is not None:
                with timers("reference_model"), roles.on_device(self.reference, args.offload_ref_reward, timers):
                    exp.ref_logp = policy_logprobs([self.reference], exp, plan, args.temperature)

            with timers("update"):
                actor_metrics = ppo_update(self.actor, exp, plan, args, self._loss, iteration, group_size=n)

        metrics = {
            **prefixed("actor", {k: v for k, v in actor_metrics.items() if k not in ("grad_norm", "lr")}),
            "grad_norm": actor_metrics["grad_norm"],
            "actor/lr": actor_metrics["lr"],
            # score: what the verifiers / reward model gave; rewards: what the advantages are computed from (the
            # same here, since GRPO's KL is a loss, not a reward penalty); advantages: after --adv-estimator
            **mean_min_max("grpo/score", exp.scores),
            **mean_min_max("grpo/rewards", exp.scores),
            **mean_min_max("grpo/advantages", advantages),
            **score_metrics,
            **rollout_stats,
            "n_samples_per_prompt": n,
        }
        if args.filter_groups:
            metrics["grpo/filtered_groups"] = float(1.0 - informative.float().mean())
        metrics.update(timers.pop())
        return metrics

    # ------------------------------------------------------------------ loss closure (per micro-batch)
    def _loss(self, logits, mb):
        kl_coef = self.args.kl_coef if self.reference is not None else 0.0
        loss, m = clipped_policy_loss(self.args, logits, mb, kl_coef)
        if "kl_loss" not in m:  # --kl-coef 0: the column stays, at zero
            m["kl_loss"] = m["pg_loss"].new_zeros(())
        return loss, {k: m[k] for k in ACTOR_METRICS}


def _advantage_estimator(args):
    """`--adv-estimator` from `core_algos.OUTCOME_ADVANTAGES`, with `--adv-scale` when given (else the
    estimator's own default); checked on a dummy group now, so a bad pair fails before any model loads."""
    estimator = core_algos.OUTCOME_ADVANTAGES.get(args.adv_estimator)
    if estimator is None:
        raise ArgumentError(f"--adv-estimator {args.adv_estimator}: unknown; valid names: "
                            f"{', '.join(sorted(core_algos.OUTCOME_ADVANTAGES))}")
    options = {} if args.adv_scale is None else {"scale": args.adv_scale}
    try:
        estimator(torch.zeros(args.n_samples_per_prompt), args.n_samples_per_prompt, **options)
    except ValueError as exc:
        raise ArgumentError(f"--adv-estimator {args.adv_estimator}: {exc}") from exc
    return functools.partial(estimator, **options)
