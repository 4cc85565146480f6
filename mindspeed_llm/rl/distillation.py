"""On-policy distillation in the stages (--teacher-load; docs/algorithms.md, "On-policy distillation (teacher)"):
the student (the actor) samples, a frozen teacher scores every sampled token, and the student is moved towards it.
The math is `core_algos/distill.py`'s; this is what the stages call.

Per iteration, at training time on the complete samples (so partial rollouts, replays and resumes need nothing of
their own: the teacher is frozen and holds no state), `score` runs one teacher forward over the batch
(`timing/teacher`, offloaded with --offload-ref-reward like the reference): its log-probs of the sampled tokens at
the rollout temperature and, for topk_forward_kl, its top-k per response position, kept on the experience
(`teacher_logp`, `teacher_topk_ids`, `teacher_topk_logp`). Then, by --distill-mode:

* reward: a per-token KL to the teacher (k1 / k3 from the policy's log-probs before the update, `old_logp`;
  topk_forward_kl from one more forward of the policy, no gradient) becomes the per-token reward
  ``-coef * KL`` on the model's own tokens (`action_mask`: tool tokens are never distilled). grpo adds it to the
  advantages after an outcome estimator's group advantage, or to the token rewards of a token estimator before
  its discounted sum; trl_ppo to the token rewards (with the KL penalty) before GAE.
* loss (grpo): ``coef x`` the distillation loss of the policy's current log-probs (k3) or logits
  (topk_forward_kl) is added to the policy loss in the loss closure, aggregated by --loss-agg-mode with the
  mini-batch's totals (`loss_term`).

Metrics: `distill/teacher_logp_mean`, `distill/kl_mean` (the reward's KL; in the loss mode the update's, a mean over
its steps), `distill/topk_mass` (topk_forward_kl: the teacher's probability its top-k covers), `distill/loss` (loss
mode).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from mindspeed_llm.distributed import sum_over_data_parallel
from mindspeed_llm.rl.core_algos.distill import (DISTILL_LOSSES, distill_token_rewards, reverse_kl, reverse_kl_loss,
                                                 topk_kl_loss)
from mindspeed_llm.rl.experience import Experience
from mindspeed_llm.rl.settings import Settings
from mindspeed_llm.rl.update import roles
from mindspeed_llm.rl.update.passes import response_topk_kl, student_topk_kl, teacher_scores

# the loss mode's per-step metrics, among the actor's (renamed `distill/*` for the log, `update_metrics`)
LOSS_METRICS = ("distill_kl", "distill_loss")


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """The mean of `values` over `mask`'s tokens of the whole batch (summed over the DP ranks); 0 without tokens."""
    m = mask.to(torch.float64)
    totals = sum_over_data_parallel(torch.stack([(values.detach().double() * m).sum(), m.sum()]))
    return float(totals[0] / totals[1]) if float(totals[1]) else 0.0


class Distillation:
    """The run's teacher and how its signal enters training (`rl/settings.DistillSettings`)."""

    def __init__(self, settings: Settings, teacher, vocab_size: Optional[int] = None):
        distill = settings.distill
        self.teacher = teacher
        # the actor's vocabulary: a teacher padded to more rows is read over these ids only
        self.vocab_size = vocab_size
        self.estimator, self.mode, self.coef = distill.distill_loss, distill.distill_mode, float(distill.distill_coef)
        self.sampled = DISTILL_LOSSES[self.estimator].inputs == "sampled"
        self.topk = None if self.sampled else int(distill.distill_topk)
        # the teacher's log-probs at the sampler's temperature (the policy's are at --temperature too: LossSettings)
        self.temperature = settings.sampling.temperature
        self.offload = settings.offload.offload_ref_reward
        self.agg, self.max_len = settings.loss.loss_agg_mode, settings.loss.max_new_tokens

    @classmethod
    def build(cls, settings: Settings, build: "roles.RoleFactory", actor) -> Optional["Distillation"]:
        """The run's distillation, its teacher loaded (None without --teacher-load)."""
        if not settings.distill.teacher_load:
            return None
        vocab_size = actor.module.model_spec.vocab_size
        return cls(settings, build.teacher(vocab_size), vocab_size)

    @property
    def in_reward(self) -> bool:
        return self.mode == "reward"

    @property
    def needs_old_logp(self) -> bool:
        """The reward's k1 / k3 compare the policy's log-probs before the update with the teacher's."""
        return self.in_reward and self.sampled

    @property
    def actor_metrics(self) -> Tuple[str, ...]:
        """The loss closure's metrics this adds to the actor's."""
        return () if self.in_reward else LOSS_METRICS

    def score(self, exp: Experience, plan, timers, student) -> Tuple[Dict[str, float], Optional[torch.Tensor]]:
        """The teacher's pass over `exp` (its reads kept on `exp`); returns (the metrics, the per-token rewards
        `[B, R]` of the reward mode, else None). `student`: the actor's chunks (the reward mode of topk_forward_kl
        runs them once more for the KL)."""
        with timers("teacher"), roles.on_device(self.teacher, self.offload, timers) as teacher:
            exp.teacher_logp, top = teacher_scores([teacher], exp, plan, self.temperature, self.topk,
                                                   self.vocab_size)
        actions = exp.action_mask  # the model's own tokens: tool tokens are never distilled
        metrics = {"distill/teacher_logp_mean": _masked_mean(exp.teacher_logp, actions)}
        if top is not None:
            exp.teacher_topk_ids, exp.teacher_topk_logp = top
            metrics["distill/topk_mass"] = _masked_mean(top.logp.exp().sum(-1), actions)
        if not self.in_reward:
            return metrics, None
        if self.sampled:
            kl = reverse_kl(exp.old_logp, exp.teacher_logp, self.estimator)
        else:
            with timers("teacher_kl"):
                kl = student_topk_kl(student, exp, plan, self.temperature)
        metrics["distill/kl_mean"] = _masked_mean(kl, actions)
        return metrics, distill_token_rewards(kl, actions, self.coef)

    def loss_term(self, logits, logp, micro_batch) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """The loss mode's term of one micro-batch: ``coef x`` its share of the distillation loss (aggregated as
        the policy loss: --loss-agg-mode, the mini-batch's totals), from the policy's current log-probs `logp`
        (k3) or `logits` (topk_forward_kl), over the loss mask."""
        options = dict(max_len=self.max_len, total_tokens=micro_batch["total_tokens"],
                       total_sequences=micro_batch["total_sequences"])
        mask = micro_batch["loss_mask"]
        if self.sampled:
            loss, m = reverse_kl_loss(logp, micro_batch["teacher_logp"], mask, self.estimator, self.agg, **options)
        else:
            kl, mass = response_topk_kl(logits, micro_batch, self.temperature)
            loss, m = topk_kl_loss(kl, mass, mask, self.agg, **options)
        return self.coef * loss, {"distill_kl": m["kl"], "distill_loss": self.coef * m["loss"]}

    def update_metrics(self, actor_metrics: Dict[str, float]) -> Dict[str, float]:
        """The loss mode's update metrics, taken out of `actor_metrics` as `distill/kl_mean`, `distill/loss` (none on
        a pipeline stage without the losses: the trainer logs the last stage's metrics)."""
        if self.in_reward or "distill_kl" not in actor_metrics:
            return {}
        return {"distill/kl_mean": actor_metrics.pop("distill_kl"), "distill/loss": actor_metrics.pop("distill_loss")}
