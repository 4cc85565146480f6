"""Loss aggregation (token / sequence means, as shares of a split batch) and the losses: the clipped-surrogate
policy loss (PPO / GRPO / DAPO / Dr. GRPO) with its KL and entropy terms, and the clipped value loss."""

from __future__ import annotations

import torch

from mindspeed_llm.rl.core_algos.kl import kl_penalty

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregation_weights(mask: torch.Tensor, mode: str, max_len=None, *, total_tokens=None,
                        total_sequences=None) -> torch.Tensor:
    """Per-token weights ``w`` ``[B, T]`` such that a loss aggregation is ``sum_{b,t} L[b, t] * w[b, t]``.

    With ``m`` the mask, ``N`` the number of tokens (``sum m``), ``S`` the number of sequences and ``n_b``
    the tokens of row ``b`` (``sum_t m[b, t]``):

    * ``token-mean``:               ``w = m / max(N, 1)``
      (TRL GRPO ``bnpo``, and ``dapo``: the tokens of the whole batch; verl's ``token-mean``).
    * ``seq-mean-token-sum``:       ``w = m / S``.
    * ``seq-mean-token-mean``:      ``w = m / (max(n_b, 1) * S)`` (TRL GRPO ``grpo``).
    * ``seq-mean-token-sum-norm``:  ``w = m / (max_len * S)`` (Dr. GRPO, TRL ``dr_grpo`` with
      ``max_len = max_completion_length``); ``max_len`` defaults to ``T``.

    ``N`` and ``S`` default to this tensor's own (``S = B``: an empty row still counts in the sequence
    mean, as in TRL). For a batch split into micro-batches and data-parallel shards, pass the WHOLE batch's
    ``total_tokens`` (its loss tokens) and ``total_sequences`` (its sequences in the loss): then each
    shard's ``sum(L * w)`` is its share, and the shares add up to the batch's loss exactly, so the result
    does not depend on how the batch was split (verl's global token / sequence normalisation).
    """
    m = mask if mask.is_floating_point() else mask.to(torch.float32)

    def total(value, local):
        return local.clamp(min=1) if value is None else torch.as_tensor(value, dtype=m.dtype, device=m.device).clamp(min=1)

    if mode == "token-mean":
        return m / total(total_tokens, m.sum())
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes are: {', '.join(AGG_MODES)}")
    sequences = total(total_sequences, torch.tensor(float(m.size(0)), dtype=m.dtype, device=m.device))
    if mode == "seq-mean-token-sum":
        return m / sequences
    if mode == "seq-mean-token-mean":
        return m / (m.sum(dim=-1, keepdim=True).clamp(min=1) * sequences)
    norm = m.size(-1) if max_len is None else max_len
    return m / (norm * sequences)


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, max_len=None, *, total_tokens=None,
                   total_sequences=None) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar: ``sum(L * aggregation_weights(mask, mode, ...))``.

    See :func:`aggregation_weights` for the modes and for the totals of a split batch. DAPO / TRL ``dapo``:
    ``token-mean`` with ``total_tokens`` the response tokens of the whole generation batch.
    Masked-out positions must be finite (the mask multiplies the loss).
    """
    weights = aggregation_weights(mask, mode, max_len, total_tokens=total_tokens, total_sequences=total_sequences)
    return (loss_mat * weights).sum()


def policy_loss(
    logp,
    old_logp,
    advantages,
    response_mask,
    clip_low=0.2,
    clip_high=None,
    dual_clip=None,
    agg="token-mean",
    *,
    max_len=None,
    ref_logp=None,
    kl_coef=0.0,
    kl_kind="low_var_kl",
    entropy=None,
    entropy_coeff=0.0,
    total_tokens=None,
    total_sequences=None,
):
    """Clipped-surrogate policy loss (PPO / GRPO / DAPO / Dr. GRPO) with optional KL and entropy terms.

    One function computes the loss and all its metrics from the same intermediates. Per token, with
    ``A`` the advantage (``[B, T]``, or ``[B]`` broadcast over tokens as in GRPO)::

        r        = exp(logp - old_logp)
        l1       = -A * r
        l2       = -A * clip(r, 1 - clip_low, 1 + clip_high)           (clip_high None -> clip_low)
        pg       = max(l1, l2)                                          (PPO clipped surrogate)
        pg       = min(pg, -A * dual_clip)   where A < 0                (dual-clip PPO, c > 1; optional)
        kl       = kl_penalty(logp, ref_logp, kl_kind)                  (only if kl_coef != 0)

        loss = agg(pg) + kl_coef * agg(kl) - entropy_coeff * token_mean(entropy)

    ``agg`` is :func:`aggregate_loss` with mode ``agg`` (``max_len`` for ``seq-mean-token-sum-norm``) over
    ``response_mask``, the loss mask (response tokens that take part in the loss). Because every mode is
    linear, ``agg(pg) + beta * agg(kl) = agg(pg + beta * kl)``, which is how TRL's GRPO adds
    ``beta * per_token_kl`` to the per-token loss before aggregating. The entropy bonus is the masked token
    mean of ``entropy`` whatever ``agg`` is (TRL 1.12 GRPO's definition).

    ``total_tokens`` / ``total_sequences``: the whole batch's, when this is one micro-batch or shard of it
    (:func:`aggregation_weights`); the loss and every metric are then this part's share of the batch's
    value, and the shares add up. Default: this tensor is the whole batch.

    TRL 1.12 mapping: PPO ``pg_loss`` = ``agg="token-mean"``; GRPO ``loss_type`` ``grpo`` ->
    ``seq-mean-token-mean``, ``bnpo`` -> ``token-mean``, ``dr_grpo`` -> ``seq-mean-token-sum-norm`` with
    ``max_len=max_completion_length``, ``dapo`` -> ``token-mean`` over the generation batch (see
    :func:`aggregate_loss`); ``beta`` -> ``kl_coef`` with ``kl_kind="k3"``; ``epsilon`` /
    ``epsilon_high`` -> ``clip_low`` / ``clip_high``; ``entropy_coef`` -> ``entropy_coeff``.

    Metrics (detached, token means over ``response_mask``):

    * ``pg_loss``: ``agg(pg)``; ``pg_clipfrac``: fraction with ``l2 > l1`` (the clip is active; equals
      TRL GRPO's ``clip_ratio/region_mean``); ``pg_clipfrac_lower``: fraction where the dual clip is
      active (0 without dual clip);
    * ``ppo_kl``: ``mean(old_logp - logp)`` (k1 estimate of KL(old || new)); ``approx_kl``:
      ``0.5 * mean((logp - old_logp)^2)`` (TRL PPO's ``approxkl``, here masked);
    * ``ppo_ratio``: ``mean(r)``; ``ppo_ratio_clamped``: ``mean(clip(r))`` (MindSpeed's names);
    * ``abs_pg_loss``: ``mean(max(|l1|, |l2|))`` -- MindSpeed-LLM trl_ppo's "absolute policy gradient
      loss", a magnitude for monitoring that does not cancel between positive and negative advantages;
    * with a KL term: ``kl_loss`` = ``agg(kl)``, ``kl`` = token mean of ``kl``; with entropy:
      ``entropy`` = token mean; always ``loss``.

    Returns:
        ``(loss, metrics)``.
    """
    if clip_high is None:
        clip_high = clip_low
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1.0 (got {dual_clip})")
    if advantages.dim() == logp.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    mask = response_mask.to(logp.dtype)
    loss_w = aggregation_weights(mask, agg, max_len, total_tokens=total_tokens, total_sequences=total_sequences)
    token_w = aggregation_weights(mask, "token-mean", total_tokens=total_tokens)

    def token_mean(x):
        return (x * token_w).sum()

    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    ratio_clamped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    l1 = -advantages * ratio
    l2 = -advantages * ratio_clamped
    pg = torch.maximum(l1, l2)
    if dual_clip is not None:
        l3 = -advantages * dual_clip
        dual_active = (advantages < 0) & (pg > l3)
        pg = torch.where(dual_active, l3, pg)
    pg_loss = (pg * loss_w).sum()
    loss = pg_loss

    with torch.no_grad():
        metrics = {
            "pg_loss": pg_loss.detach(),
            "pg_clipfrac": token_mean((l2 > l1).to(mask.dtype)),
            "pg_clipfrac_lower": (
                token_mean(dual_active.to(mask.dtype))
                if dual_clip is not None
                else torch.zeros((), dtype=mask.dtype, device=mask.device)
            ),
            "ppo_kl": token_mean(-log_ratio),
            "approx_kl": token_mean(0.5 * log_ratio.square()),
            "ppo_ratio": token_mean(ratio),
            "ppo_ratio_clamped": token_mean(ratio_clamped),
            "abs_pg_loss": token_mean(torch.maximum(l1.abs(), l2.abs())),
        }

    if kl_coef != 0.0:
        if ref_logp is None:
            raise ValueError("policy_loss: kl_coef != 0 needs ref_logp")
        kl = kl_penalty(logp, ref_logp, kl_kind)
        kl_loss = (kl * loss_w).sum()
        loss = loss + kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
        metrics["kl"] = token_mean(kl.detach())

    if entropy is not None:
        entropy_mean = token_mean(entropy)
        if entropy_coeff != 0.0:
            loss = loss - entropy_coeff * entropy_mean
        metrics["entropy"] = entropy_mean.detach()
    elif entropy_coeff != 0.0:
        raise ValueError("policy_loss: entropy_coeff != 0 needs entropy")

    metrics["loss"] = loss.detach()
    return loss, metrics


def value_loss(values, old_values, returns, value_mask, cliprange_value=0.2, *, total_tokens=None):
    """Clipped value-function loss (TRL 1.12 PPO).

    ::

        v_clip = clip(values, old_values - cliprange_value, old_values + cliprange_value)
        vf1    = (values - returns)^2
        vf2    = (v_clip - returns)^2
        loss   = 0.5 * masked_mean(max(vf1, vf2), value_mask)

    ``value_mask`` is TRL's ``~padding_mask_p1`` (:func:`response_mask_p1`) for TRL's convention.
    ``total_tokens``: the whole batch's ``sum(value_mask)`` when this is a part of it; the loss and the
    metrics are then this part's shares (:func:`aggregation_weights`).

    Metrics (detached): ``vf_loss`` (= loss), ``vf_clipfrac`` = ``masked_mean(vf2 > vf1)``,
    ``vpred`` = masked mean of ``values``, ``returns`` = masked mean of ``returns``.
    """
    mask = value_mask.to(values.dtype)
    token_w = aggregation_weights(mask, "token-mean", total_tokens=total_tokens)
    v_clip = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    vf1 = (values - returns).square()
    vf2 = (v_clip - returns).square()
    loss = 0.5 * (torch.maximum(vf1, vf2) * token_w).sum()
    with torch.no_grad():
        metrics = {
            "vf_loss": loss.detach(),
            "vf_clipfrac": ((vf2 > vf1).to(mask.dtype) * token_w).sum(),
            "vpred": (values * token_w).sum(),
            "returns": (returns * token_w).sum(),
        }
    return loss, metrics
