"""KL estimators: the per-token estimate of ``KL(pi || pi_ref)`` from the log-probs of the sampled tokens, used
by the PPO token rewards (:mod:`.rewards`) and by the policy loss's KL term (:mod:`.losses`); and the rollout
mismatch statistics (sampler vs training forward)."""

from __future__ import annotations

import torch

KL_KINDS = ("k1", "k2", "k3", "low_var_kl", "abs")

# Bounds used by the k3 / low_var_kl estimator (as in verl and MindSpeed-RL): the log-ratio is clamped
# before exp() so it cannot overflow, and the estimate itself is clamped to [-10, 10].
K3_LOG_RATIO_BOUND = 20.0
K3_VALUE_BOUND = 10.0


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from the log-probs of the sampled tokens.

    With ``log_r = ref_logp - logp`` (log of pi_ref / pi at the sampled token):

    * ``k1``: ``-log_r = logp - ref_logp`` (unbiased, high variance; TRL PPO's default).
    * ``k2``: ``0.5 * log_r^2``.
    * ``k3`` (alias ``low_var_kl``): ``exp(log_r) - log_r - 1`` (unbiased, low variance, >= 0). As in
      verl / MindSpeed-RL, ``log_r`` is clamped to [-20, 20] before ``exp`` and the result to [-10, 10].
      This is TRL's ``kl_estimator="k3"`` (PPO) and GRPO's ``per_token_kl`` whenever the clamps are
      inactive.
    * ``abs``: ``|logp - ref_logp|``.

    Returns an unmasked tensor of the broadcast shape. Raises ``ValueError`` for an unknown ``kind``.
    """
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (ref_logp - logp).square()
    if kind in ("k3", "low_var_kl"):
        log_r = (ref_logp - logp).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
        return (torch.exp(log_r) - log_r - 1).clamp(-K3_VALUE_BOUND, K3_VALUE_BOUND)
    if kind == "abs":
        return (logp - ref_logp).abs()
    raise ValueError(f"unknown KL estimator kind {kind!r}; valid kinds are: {', '.join(KL_KINDS)}")


def rollout_mismatch(old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor) -> dict:
    """How far the sampler's log-probs are from the training forward's, over the response tokens (detached).

    With ``d_t = rollout_logp_t - old_logp_t`` on the tokens of ``response_mask``:

    * ``abs_diff_mean``: ``mean |d_t|``; ``abs_diff_max``: ``max |d_t|`` (TRL's
      ``sampling/sampling_logp_difference/{mean,max}``);
    * ``k3_kl``: ``mean(exp(-d_t) + d_t - 1)``, the k3 estimate of KL(rollout || training) from the sampled tokens
      (:func:`kl_penalty` ``k3`` with the rollout as the sampling policy).

    Returns 0-d tensors; all 0 when the mask selects nothing.
    """
    with torch.no_grad():
        mask = response_mask.bool()
        diff = (rollout_logp - old_logp)[mask]
        if diff.numel() == 0:
            zero = torch.zeros((), dtype=old_logp.dtype, device=old_logp.device)
            return {"abs_diff_mean": zero, "abs_diff_max": zero, "k3_kl": zero}
        k3 = kl_penalty(rollout_logp[mask], old_logp[mask], "k3")
        return {"abs_diff_mean": diff.abs().mean(), "abs_diff_max": diff.abs().max(), "k3_kl": k3.mean()}
