"""KL estimators: the per-token estimate of ``KL(pi || pi_ref)`` from the log-probs of the sampled tokens, used
by the PPO token rewards (:mod:`.rewards`) and by the policy loss's KL term (:mod:`.losses`)."""

from __future__ import annotations

import torch

KL_KINDS = ("k1", "k2", "k3", "low_var_kl", "abs")

# Bounds used by the k3 / low_var_kl estimator (as in verl and MindSpeed-RL): the log-ratio is clamped
# before exp() so it cannot overflow, and the estimate itself is clamped to [-10, 10].
_K3_LOG_RATIO_BOUND = 20.0
_K3_VALUE_BOUND = 10.0


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
        log_r = (ref_logp - logp).clamp(-_K3_LOG_RATIO_BOUND, _K3_LOG_RATIO_BOUND)
        return (torch.exp(log_r) - log_r - 1).clamp(-_K3_VALUE_BOUND, _K3_VALUE_BOUND)
    if kind == "abs":
        return (logp - ref_logp).abs()
    raise ValueError(f"unknown KL estimator kind {kind!r}; valid kinds are: {', '.join(KL_KINDS)}")
