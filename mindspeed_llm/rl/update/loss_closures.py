"""The loss closures of the trained roles: what `TrainableModel.train_step` calls on each micro-batch, from the run's
`LossSettings` (`rl/settings.py`); the math itself is `core_algos` (`core_algos/losses.py`)."""

from __future__ import annotations

from mindspeed_llm.rl import core_algos
from mindspeed_llm.rl.update.passes import response_logprobs, response_values
from mindspeed_llm.rl.settings import LossSettings


def clipped_policy_loss(loss: LossSettings, logits, micro_batch, kl_coef: float = 0.0, extra_term=None):
    """The actor's loss of both stages on one micro-batch: the clipped surrogate `--policy-loss` (vanilla:
    `--clip-ratio`, `--clip-ratio-high`, `--dual-clip`; gspo: `--gspo-clip-ratio`, `--gspo-clip-ratio-high`) under
    `--loss-agg-mode`, weighted per token by `--rollout-is` (against the sampler's log-probs), plus `kl_coef` x the KL
    to the reference (`--kl-penalty`; grpo's KL loss) and the entropy bonus (`--entropy-coeff`), over the loss mask.
    Returns (loss, metrics) as shares of the mini-batch's (its totals ride in the micro-batch, `ppo_loop`).
    Without `old_logp` in the micro-batch (see `ppo_loop.old_logp_is_current`) the old log-probs are `logp`'s.
    `extra_term(logits, logp, micro_batch) -> (loss, metrics)`: a term added to the loss (its metrics to the
    policy loss's), given the log-probs computed here (distillation's loss mode, `rl/distillation.py`)."""
    logp, entropy = response_logprobs(logits, micro_batch, loss.temperature, with_entropy=True)
    old_logp = micro_batch.get("old_logp")
    gspo = loss.policy_loss == "gspo"
    total, metrics = core_algos.policy_loss(
        logp, logp.detach() if old_logp is None else old_logp, micro_batch["advantages"], micro_batch["loss_mask"],
        clip_low=loss.gspo_clip_ratio if gspo else loss.clip_ratio,
        clip_high=loss.gspo_clip_ratio_high if gspo else loss.clip_ratio_high, dual_clip=loss.dual_clip,
        agg=loss.loss_agg_mode, loss_type=loss.policy_loss, max_len=loss.max_new_tokens,
        ref_logp=micro_batch.get("ref_logp"), kl_coef=kl_coef, kl_kind=loss.kl_penalty, entropy=entropy,
        entropy_coeff=loss.entropy_coeff, rollout_logp=micro_batch.get("rollout_logp"), rollout_is=loss.rollout_is,
        rollout_is_threshold=loss.rollout_is_threshold,
        total_tokens=micro_batch["total_tokens"], total_sequences=micro_batch["total_sequences"],
    )
    if extra_term is not None:
        term, term_metrics = extra_term(logits, logp, micro_batch)
        total = total + term
        metrics = {**metrics, **term_metrics}
    return total, metrics


def clipped_value_loss(loss: LossSettings, output, micro_batch):
    """The critic's loss on one micro-batch: TRL's clipped value loss (`--cliprange-value`) on the loss mask plus
    one position (TRL's value mask), scaled by `--vf-coef`. Returns (loss, metrics) as shares of the
    mini-batch's."""
    values = response_values(output, micro_batch)
    value_loss, metrics = core_algos.value_loss(
        values, micro_batch["values"], micro_batch["returns"],
        core_algos.critic_mask(micro_batch["loss_mask"], micro_batch["response_mask"]),
        loss.cliprange_value, total_tokens=micro_batch["total_value_tokens"],
    )
    return loss.vf_coef * value_loss, metrics
