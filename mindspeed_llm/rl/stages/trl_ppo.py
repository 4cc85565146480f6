"""`--stage trl_ppo`: TRL-style PPO with actor, reference, critic and reward model in one SPMD group.

One iteration (docs/architecture.md, "One iteration"): generate (`--n-samples-per-prompt` responses per prompt,
default 1) -> old log-probs, reference log-probs, values, score -> per-token
rewards (-kl_coef * KL, score after the last token as TRL places it) -> GAE + whitened advantages
(`--adv-estimator gae`, the one estimator with a critic) -> actor (policy loss `--policy-loss`) and critic
(clipped value loss) updates per epoch and mini-batch.

Actor and reference start from `--ref-model`; critic and reward from `--reward-model` (a value-head
checkpoint). With rule verifiers (or a --judge-load judge) and `--reward-model-weight 0` the reward model is not
loaded. With LoRA the reference is the actor with its adapters off and the reward model the critic with its
adapters off and the checkpoint's value head (`rl/update/lora.py`).
With --teacher-load a frozen teacher's per-token KL is a reward term too, added to the token rewards before GAE
(`rl/distillation.py`; reward mode only).
"""

from __future__ import annotations

from typing import Dict

from mindspeed_llm import device
from mindspeed_llm.distributed import sum_over_data_parallel
from mindspeed_llm.rl import core_algos
from mindspeed_llm.rl.distillation import Distillation
from mindspeed_llm.rl.update import lora, roles
from mindspeed_llm.rl.update.batch_plan import MicroBatchPlan
from mindspeed_llm.rl.update.loss_closures import clipped_policy_loss, clipped_value_loss
from mindspeed_llm.rl.metrics import Timers, masked_mean_min_max, mean_min_max, prefixed
from mindspeed_llm.rl.update.passes import critic_values, policy_logprobs
from mindspeed_llm.rl.update.ppo_loop import old_logp_is_current, ppo_update
from mindspeed_llm.rl.rollouts.plain import mask_truncated_completions, mismatch_metrics, rollout_metrics
from mindspeed_llm.rl.rollouts.base import PromptSource
from mindspeed_llm.rl.settings import Settings
from mindspeed_llm.rl.stages.base import StageBase, Trained


# The actor's and critic's logged losses, in MindSpeed-LLM's order (`core_algos`' names; `lr`, `grad_norm` follow).
ACTOR_METRICS = ("pg_loss", "abs_pg_loss", "ppo_ratio", "ppo_ratio_clamped", "pg_clipfrac", "ppo_kl", "entropy")
CRITIC_METRICS = ("vf_loss", "vf_clipfrac")
ROLLOUT_IS_METRICS = ("rollout_is_weight", "rollout_is_clipfrac")  # with --rollout-is


class TrlPPOStage(StageBase):
    name = "trl_ppo"
    log_lines = {"actor": ["actor/", "grad_norm"], "critic": ["critic/"]}

    def __init__(self, settings: Settings, tokenizer, build: roles.RoleFactory):
        super().__init__(settings, tokenizer)
        models = settings.models
        self.gae = core_algos.ADV_ESTIMATORS[self.algorithm.adv_estimator].fn  # validate_args: a critic estimator
        self.actor_metrics = ACTOR_METRICS + (ROLLOUT_IS_METRICS if self.algorithm.rollout_is != "none" else ())
        build.check_teacher(models.ref_model)  # --teacher-load against the actor's checkpoint, before any model
        self.actor = build.trained(models.ref_model, "--ref-model", "actor")
        # with LoRA the frozen roles are the trained ones' bases (rl/update/lora.py): no second copies
        self.reference = lora.reference(self.actor) if models.lora else build.frozen(models.ref_model, "--ref-model")
        self.critic = build.trained(models.reward_model, "--reward-model", "critic", value_head=True)
        uses_reward_model = (settings.reward.reward_model_weight != 0
                             or not (settings.reward.verifier_function or settings.judge.judge_load))
        reward_model = None
        if uses_reward_model:
            reward_model = lora.reward_model(self.critic) if models.lora else build.reward_model()
        roles.check_vocab({"actor": self.actor.module, "reference": self.reference,
                           "critic": self.critic.module, "reward": reward_model}, tokenizer)
        self.distill = Distillation.build(settings, build, self.actor)  # None without --teacher-load
        self._build_rollout_side(reward_model)

    def roles(self):
        return {"actor": self.actor, "critic": self.critic}

    # ------------------------------------------------------------------ one iteration
    def _train(self, iteration: int, prompts: PromptSource) -> Trained:
        algorithm, settings, n = self.algorithm, self.settings, self.algorithm.n_samples_per_prompt
        timers = Timers(sync=device.synchronize)
        with timers("all"):
            for trained in (self.actor, self.critic):  # --offload-train-*: training state in host memory until used
                trained.offload(timers)
            with timers("rollout"):  # a prompt's n samples are consecutive rows, each with its own GAE
                exp, schedule_metrics = self.rollouts.collect(iteration, prompts)
            plan = MicroBatchPlan.for_run(exp, settings.batch, group_size=n)
            rollout_stats = rollout_metrics(exp)
            if algorithm.mask_truncated_completions:  # they leave the actor's and the critic's losses
                rollout_stats.update(mask_truncated_completions(exp))
            routing_mismatch = None  # the old-log-prob pass's, for a mixture of experts
            with timers("old_log_p"):
                on_policy = old_logp_is_current(settings.update, exp) and not algorithm.recompute_old_logprobs
                if exp.rollout_logp is not None and on_policy:
                    exp.old_logp = exp.rollout_logp  # as TRL's PPO: the generation logits' log-probs, no pass
                else:
                    exp.old_logp, routing_mismatch = policy_logprobs(
                        self.actor.chunks, exp, plan, settings.loss.temperature, compare_routing=exp.routing_recorded)
            with timers("reference_model"), roles.on_device(self.reference, settings.offload.offload_ref_reward,
                                                            timers) as reference:
                exp.ref_logp, _ = policy_logprobs([reference], exp, plan, settings.loss.temperature)
            with timers("critic_model"):
                self.critic.onload(timers, parts=("weights",))  # --offload-train-param: they left for the rollout
                exp.values = critic_values(self.critic.chunks, exp, plan)
            score_metrics = self._score(exp, plan, timers, schedule_metrics)  # with --missing-eos-penalty
            distill_metrics, distill_rewards = {}, None
            if self.distill is not None:  # timing/teacher; validate_args: the reward mode
                distill_metrics, distill_rewards = self.distill.score(exp, plan, timers, self.actor.chunks)

            with timers("adv"):
                rewards, kl = self._advantages(exp, distill_rewards)

            with timers("update"), self.actor.on_device(timers):
                actor_metrics = ppo_update(self.actor, exp, plan, settings.update, self._actor_loss, iteration,
                                           group_size=n)
            with timers("update_critic"), self.critic.on_device(timers):
                critic_metrics = ppo_update(self.critic, exp, plan, settings.update, self._critic_loss,
                                            iteration, group_size=n)

        kl_sum = kl.sum(-1)
        metrics = {
            **prefixed("actor", actor_metrics),
            "actor/kl_loss": 0.0,  # MindSpeed-RL's column: TRL's PPO puts the KL in the rewards, never in a loss
            "grad_norm": actor_metrics["grad_norm"],  # MindSpeed-RL's bare name, beside actor/grad_norm
            **prefixed("critic", critic_metrics),
            **self._critic_batch_metrics(exp, rewards),
            "score/mean": float(exp.scores.mean()),
            "kl/mean": float(kl_sum.mean()),
            "non_score_reward": float((-algorithm.kl_coef * kl_sum).mean()),
            **score_metrics,
            **schedule_metrics,
            **rollout_stats,
            **mismatch_metrics(exp, routing_mismatch),
            **distill_metrics,
            "n_samples_per_prompt": n,
        }
        metrics.update(timers.pop())
        return Trained(metrics, exp, actor_metrics)

    def _advantages(self, exp, distill_rewards=None):
        """`exp.advantages` and `exp.returns` [B, R]: TRL's token rewards (-kl_coef * KL, the score one past the last
        token, plus `distill_rewards` [B, R] with --teacher-load; whitened with --whiten-rewards) and GAE, all on
        the model's own tokens (the action mask: the response mask without tool tokens), GAE stepping over them only
        (`core_algos.gae_over_actions`). Returns (the token rewards, the per-token KL)."""
        algorithm = self.algorithm
        actions = exp.action_mask
        rewards, kl = core_algos.compute_token_rewards(
            exp.scores, exp.old_logp, exp.ref_logp, actions, algorithm.kl_coef, self.settings.loss.kl_penalty
        )
        if distill_rewards is not None:
            rewards = rewards + distill_rewards
        value_mask = core_algos.response_mask_p1(actions)
        if algorithm.whiten_rewards:
            rewards = core_algos.masked_whiten(rewards, value_mask, shift_mean=False,
                                               sum_across=sum_over_data_parallel) * value_mask
        exp.advantages, exp.returns = core_algos.gae_over_actions(
            rewards, exp.values, exp.response_mask, exp.tool_mask, algorithm.gamma, algorithm.lam,
            whiten=True, value_mask=value_mask, sum_across=sum_over_data_parallel, gae=self.gae,
        )
        return rewards, kl

    @staticmethod
    def _critic_batch_metrics(exp, rewards) -> Dict[str, float]:
        """MindSpeed-RL's PPO log: `critic/score` per sample, `critic/rewards` the per-sample sum of the token
        rewards (score plus the KL penalty, whitened with --whiten-rewards), `critic/{advantages,returns,values}`
        over the model's own response tokens (a mean over the whole batch's tokens; tool tokens have none)."""
        mask = exp.action_mask
        return {
            **mean_min_max("critic/score", exp.scores),
            **mean_min_max("critic/rewards", rewards.sum(-1)),
            **masked_mean_min_max("critic/advantages", exp.advantages, mask, sum_over_data_parallel),
            **masked_mean_min_max("critic/returns", exp.returns, mask, sum_over_data_parallel),
            **masked_mean_min_max("critic/values", exp.values, mask, sum_over_data_parallel),
        }

    # ------------------------------------------------------------------ loss closures (per micro-batch)
    def _actor_loss(self, logits, mb):
        loss, m = clipped_policy_loss(self.settings.loss, logits, mb)  # TRL's PPO: the KL is in the reward
        return loss, {k: m[k] for k in self.actor_metrics}

    def _critic_loss(self, output, mb):
        loss, m = clipped_value_loss(self.settings.loss, output, mb)
        return loss, {k: m[k] for k in CRITIC_METRICS}
