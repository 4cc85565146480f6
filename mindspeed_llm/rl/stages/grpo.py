"""`--stage grpo`: Group Relative Policy Optimization.

One iteration: each prompt sampled `--n-samples-per-prompt` times -> rule verifiers and/or reward model (with the
penalties, `scoring.py`) -> old and reference log-probs -> advantages (`--adv-estimator`, a critic-free estimator of
`core_algos.ADV_ESTIMATORS`: per sample from the scores -- grpo, dr_grpo, rloo -- or per token from the token rewards
-- reinforce_plus_plus, whose KL to the reference is a reward penalty instead of a loss, and
reinforce_plus_plus_baseline) -> policy loss (`--policy-loss`) + KL loss (+ entropy bonus) -> update. No critic. The
reference starts from `--ref-model` (default: the initial actor) and is skipped when `--kl-coef 0`; with LoRA it is
the actor with its adapters off (`rl/update/lora.py`). With --teacher-load a frozen teacher scores the samples
before the advantages: its KL is a per-token reward or a loss term (`rl/distillation.py`).
"""

from __future__ import annotations

import functools
import os

import torch

from mindspeed_llm import device
from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.distributed import sum_over_data_parallel
from mindspeed_llm.rl import core_algos
from mindspeed_llm.rl.distillation import Distillation
from mindspeed_llm.rl.update import lora, roles
from mindspeed_llm.rl.update.batch_plan import MicroBatchPlan
from mindspeed_llm.rl.rollouts.dynamic_sampling import informative_groups, refill
from mindspeed_llm.rl.update.loss_closures import clipped_policy_loss
from mindspeed_llm.rl.metrics import Timers, mean_min_max, prefixed
from mindspeed_llm.rl.update.passes import policy_logprobs
from mindspeed_llm.rl.update.ppo_loop import old_logp_is_current, ppo_update
from mindspeed_llm.rl.rollouts.plain import mask_truncated_completions, mismatch_metrics, rollout_metrics
from mindspeed_llm.rl.rollouts.base import PromptSource
from mindspeed_llm.rl.settings import AlgorithmSettings, Settings
from mindspeed_llm.rl.stages.base import StageBase, Trained


# The actor's logged losses (`core_algos`' names; `actor/lr` and the bare `grad_norm` follow, as MindSpeed-RL logs).
ACTOR_METRICS = ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss")
ROLLOUT_IS_METRICS = ("rollout_is_weight", "rollout_is_clipfrac")  # with --rollout-is


class GRPOStage(StageBase):
    name = "grpo"
    log_lines = {"actor": ["actor/", "grad_norm"], "reward": ["grpo/"], "timing": ["timing/"]}

    def __init__(self, settings: Settings, tokenizer, build: roles.RoleFactory):
        super().__init__(settings, tokenizer)
        models = settings.models
        self.estimator, self.advantages = _advantage_estimator(self.algorithm)
        self.actor_metrics = ACTOR_METRICS + (ROLLOUT_IS_METRICS if self.algorithm.rollout_is != "none" else ())
        if not models.ref_model and os.path.isdir(os.path.join(models.load, "actor")):
            raise ArgumentError(
                f"--load {models.load} is a grpo --save directory: pass --ref-model with the original weights too "
                "(the reference model always comes from them; the actor resumes from --load)"
            )
        initial = models.ref_model or models.load
        flag = "--ref-model" if models.ref_model else "--load"
        build.check_teacher(initial)  # --teacher-load against the actor's checkpoint, before any model is built
        self.actor = build.trained(initial, flag, "actor")
        self.reference = None
        if self.algorithm.kl_coef > 0:  # with LoRA: the actor with its adapters off, no second copy (rl/update/lora.py)
            self.reference = lora.reference(self.actor) if models.lora else build.frozen(initial, flag)
        reward_model = build.reward_model() if models.reward_model else None
        roles.check_vocab({"actor": self.actor.module, "reference": self.reference, "reward": reward_model},
                          tokenizer)
        self.distill = Distillation.build(settings, build, self.actor)  # None without --teacher-load
        if self.distill is not None:
            self.actor_metrics += self.distill.actor_metrics
        self._build_rollout_side(reward_model)

    def roles(self):
        return {"actor": self.actor}

    # ------------------------------------------------------------------ one iteration
    def _train(self, iteration: int, prompts: PromptSource) -> Trained:
        algorithm, settings, n = self.algorithm, self.settings, self.algorithm.n_samples_per_prompt
        timers = Timers(sync=device.synchronize)
        with timers("all"):
            self.actor.offload(timers)  # --offload-train-*: the training state waits in host memory until the update
            exp, plan, score_metrics = self._generate(iteration, prompts, timers)
            if algorithm.dynamic_sampling:  # refill with more prompt groups until the batch's groups all carry signal
                exp, sampling_stats = refill(  # the DP rank's groups (its CP ranks' rows together)
                    exp, lambda j: self._generate(iteration, prompts.batch(j), timers)[0], n, exp.batch_size // n,
                    algorithm.max_num_gen_batches, algorithm.dynamic_sampling_metric)
                plan = MicroBatchPlan.for_run(exp, settings.batch, group_size=n)
                score_metrics.update(sampling_stats)
            rollout_stats = rollout_metrics(exp)
            if algorithm.mask_truncated_completions:
                rollout_stats.update(mask_truncated_completions(exp))

            routing_mismatch = None  # the old-log-prob pass's, for a mixture of experts
            with timers("old_log_p"):  # ~0 s when the update's own log-probs are the old ones
                # a pass of its own when the update takes several steps, when the KL is a reward penalty (it is
                # computed before the update), and with --recompute-old-logprobs / --rollout-is
                if (algorithm.recompute_old_logprobs or self.estimator.kl_in_reward
                        or (self.distill is not None and self.distill.needs_old_logp)
                        or not old_logp_is_current(settings.update, exp)):
                    exp.old_logp, routing_mismatch = policy_logprobs(
                        self.actor.chunks, exp, plan, settings.loss.temperature, compare_routing=exp.routing_recorded)
            if self.reference is not None:
                with timers("reference_model"), roles.on_device(self.reference, settings.offload.offload_ref_reward,
                                                                timers) as reference:
                    exp.ref_logp, _ = policy_logprobs([reference], exp, plan, settings.loss.temperature)
            distill_metrics, distill_rewards = {}, None
            if self.distill is not None:  # timing/teacher
                distill_metrics, distill_rewards = self.distill.score(exp, plan, timers, self.actor.chunks)

            with timers("adv"):
                rewards, advantages = self._advantages(exp, distill_rewards)
                if algorithm.filter_groups:
                    # Groups whose samples all scored the same carry no signal; their tokens leave the loss
                    # (its mask, so shapes and step counts stay equal on every rank; no refill).
                    informative = informative_groups(exp.scores, n)
                    exp.filtered_out = ~informative.repeat_interleave(n)

            with timers("update"), self.actor.on_device(timers):
                actor_metrics = ppo_update(self.actor, exp, plan, settings.update, self._loss, iteration, group_size=n)
            if self.distill is not None:
                distill_metrics.update(self.distill.update_metrics(actor_metrics))

        metrics = {
            **prefixed("actor", {k: v for k, v in actor_metrics.items() if k not in ("grad_norm", "lr")}),
            "grad_norm": actor_metrics["grad_norm"],
            "actor/lr": actor_metrics["lr"],
            # score: what the verifiers / reward model gave; rewards: what the advantages are computed from (the
            # score, less the KL penalty with reinforce_plus_plus); advantages: after --adv-estimator
            **mean_min_max("grpo/score", exp.scores),
            **mean_min_max("grpo/rewards", rewards),
            **mean_min_max("grpo/advantages", advantages),
            **score_metrics,
            **rollout_stats,
            **mismatch_metrics(exp, routing_mismatch),
            **distill_metrics,
            "n_samples_per_prompt": n,
        }
        if algorithm.filter_groups:
            metrics["grpo/filtered_groups"] = float(1.0 - informative.float().mean())
        metrics.update(timers.pop())
        return Trained(metrics, exp, actor_metrics)

    def _generate(self, iteration: int, prompts: PromptSource, timers):
        """The schedule's groups of `prompts` (a prompt's n samples are consecutive rows), scored:
        (experience, its micro-batch plan, the strategy's and the scorer's metrics). Every pass and the update
        compute a prompt once per group, when micro-batches hold whole groups."""
        n = self.algorithm.n_samples_per_prompt
        with timers("rollout"):
            exp, schedule_metrics = self.rollouts.collect(iteration, prompts)
        plan = MicroBatchPlan.for_run(exp, self.settings.batch, group_size=n)
        score_metrics = self._score(exp, plan, timers, schedule_metrics)  # to the records too
        return exp, plan, {**schedule_metrics, **score_metrics}

    # ------------------------------------------------------------------ loss closure (per micro-batch)
    def _advantages(self, exp, distill_rewards=None):
        """`exp.advantages` [B, R] from the estimator; returns (the per-sample rewards they come from, the advantages
        as logged: per sample -- for a token estimator its mean over the response, a statistic of whole samples like
        every logged one, which DP ranks average alike). `distill_rewards` [B, R] (--distill-mode reward, zero off
        the model's own tokens): added per token after an outcome estimator's group advantage, or to a token
        estimator's token rewards before its discounted sum."""
        n = self.algorithm.n_samples_per_prompt
        actions = exp.action_mask  # the model's own tokens: tool tokens get no advantage (core_algos/actions.py)
        if self.estimator.kind == "outcome":
            advantages = self.advantages(exp.scores, n, sum_across=sum_over_data_parallel)
            exp.advantages = advantages[:, None] * actions
            if distill_rewards is None:
                return exp.scores, advantages
            # the teacher's term makes the advantage a per-token one: logged as its mean over the sample's actions,
            # the rewards as the score plus the sample's summed distillation reward
            exp.advantages = exp.advantages + distill_rewards
            return exp.scores + distill_rewards.sum(-1), _mean_over_actions(exp.advantages, actions)
        # token estimators: the score on the last action (verl's placement), less the KL penalty on every action when
        # the estimator takes the KL in the reward (then it is no loss, `_loss`); discounted over actions only
        kl_coef = self.algorithm.kl_coef if self.estimator.kl_in_reward and self.reference is not None else 0.0
        zeros = torch.zeros_like(exp.response_mask)
        token_rewards, _ = core_algos.compute_token_rewards(
            exp.scores, exp.old_logp if kl_coef else zeros, exp.ref_logp if kl_coef else zeros, actions,
            kl_coef, self.settings.loss.kl_penalty, score_at="last")
        if distill_rewards is not None:
            token_rewards = token_rewards + distill_rewards
        exp.advantages = core_algos.token_advantages_over_actions(
            self.advantages, token_rewards, exp.response_mask, exp.tool_mask, n, sum_across=sum_over_data_parallel)
        return token_rewards.sum(-1), _mean_over_actions(exp.advantages, actions)

    def _loss(self, logits, mb):
        kl_coef = self.algorithm.kl_coef if self.reference is not None and not self.estimator.kl_in_reward else 0.0
        distill_term = None if self.distill is None or self.distill.in_reward else self.distill.loss_term
        loss, m = clipped_policy_loss(self.settings.loss, logits, mb, kl_coef, extra_term=distill_term)
        if "kl_loss" not in m:  # --kl-coef 0, or the KL is in the reward: the column stays, at zero
            m["kl_loss"] = m["pg_loss"].new_zeros(())
        return loss, {k: m[k] for k in self.actor_metrics}


def _mean_over_actions(advantages: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """Per-token advantages `[B, R]` as one number a sample: their mean over its actions (the model's own tokens)."""
    return (advantages * actions).sum(-1) / actions.sum(-1).clamp(min=1)


def _advantage_estimator(algorithm: AlgorithmSettings):
    """`--adv-estimator` from `core_algos.ADV_ESTIMATORS` (`validate_args` checked that it is critic-free): an
    outcome estimator with `--adv-scale` when given (else its own default), a token estimator with `--gamma`.
    Checked on a dummy group now, so a bad pair fails before any model loads. Returns (the registry entry, the
    estimator with its options)."""
    estimator = core_algos.ADV_ESTIMATORS.get(algorithm.adv_estimator)
    if estimator is None or estimator.kind == "critic":
        raise ArgumentError(f"--adv-estimator {algorithm.adv_estimator}: not a critic-free estimator; valid names: "
                            f"{', '.join(k for k, e in core_algos.ADV_ESTIMATORS.items() if e.kind != 'critic')}")
    n = algorithm.n_samples_per_prompt
    if estimator.kind == "outcome":
        options = {} if algorithm.adv_scale is None else {"scale": algorithm.adv_scale}
        probe = (torch.zeros(n), n)
    else:
        options = {"gamma": algorithm.gamma}
        probe = (torch.zeros(n, 1), torch.ones(n, 1), n)
    try:
        estimator.fn(*probe, **options)
    except ValueError as exc:
        raise ArgumentError(f"--adv-estimator {algorithm.adv_estimator}: {exc}") from exc
    return estimator, functools.partial(estimator.fn, **options)
