"""Loss aggregation (token / sequence means, as shares of a split batch) and the losses: the policy loss (PPO /
GRPO / DAPO / Dr. GRPO / GSPO surrogates by name, ``POLICY_LOSSES``, ``--policy-loss``) with its KL and entropy
terms and the rollout importance-sampling correction (``--rollout-is``), and the clipped value loss.

The torch code here is the reference of the fused loss kernels (``mindspeed_llm.kernels.triton_rl_losses``: loss,
metrics and gradient in one launch), which :func:`policy_loss` (built-in surrogates) and :func:`value_loss` run
instead where ``mindspeed_llm.kernels.select_kernel`` chooses them (CUDA, Ascend with Triton-Ascend;
``MINDSPEED_LOSS_KERNEL``)."""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional

import torch

from mindspeed_llm.kernels import select_kernel
from mindspeed_llm.registry import Registry
from mindspeed_llm.rl.core_algos.kl import K3_LOG_RATIO_BOUND, K3_VALUE_BOUND, KL_KINDS, kl_penalty

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ROLLOUT_IS_MODES = ("none", "tis", "mis")


def aggregation_denominator(mask: torch.Tensor, mode: str, max_len=None, *, total_tokens=None,
                            total_sequences=None) -> torch.Tensor:
    """What :func:`aggregation_weights` divides the mask by: ``w = m / denominator``, with ``denominator`` a 0-d
    tensor (``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-sum-norm``) or ``[B, 1]``
    (``seq-mean-token-mean``), in the mask's floating dtype (fp32 for a bool mask)."""
    m = mask if mask.is_floating_point() else mask.to(torch.float32)

    def total(value, local):
        if value is None:
            return local.clamp(min=1)
        return torch.as_tensor(value, dtype=m.dtype, device=m.device).clamp(min=1)

    if mode == "token-mean":
        return total(total_tokens, m.sum())
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes are: {', '.join(AGG_MODES)}")
    sequences = total(total_sequences, torch.tensor(float(m.size(0)), dtype=m.dtype, device=m.device))
    if mode == "seq-mean-token-sum":
        return sequences
    if mode == "seq-mean-token-mean":
        return m.sum(dim=-1, keepdim=True).clamp(min=1) * sequences
    norm = m.size(-1) if max_len is None else max_len
    return norm * sequences


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
    The denominators are :func:`aggregation_denominator` (what the fused loss kernels read).
    """
    m = mask if mask.is_floating_point() else mask.to(torch.float32)
    return m / aggregation_denominator(m, mode, max_len, total_tokens=total_tokens, total_sequences=total_sequences)


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, max_len=None, *, total_tokens=None,
                   total_sequences=None) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar: ``sum(L * aggregation_weights(mask, mode, ...))``.

    See :func:`aggregation_weights` for the modes and for the totals of a split batch. DAPO / TRL ``dapo``:
    ``token-mean`` with ``total_tokens`` the response tokens of the whole generation batch.
    Masked-out positions must be finite (the mask multiplies the loss).
    """
    weights = aggregation_weights(mask, mode, max_len, total_tokens=total_tokens, total_sequences=total_sequences)
    return (loss_mat * weights).sum()


class PolicyTerms(NamedTuple):
    """What a policy-loss surrogate gives, per token ``[B, T]``: ``pg`` the loss before aggregation, ``ratio`` the
    importance ratio it used and ``ratio_clamped`` its clipped value, ``clipped`` where the clip is active
    (``l2 > l1``), ``dual_clipped`` where the dual clip is (None without one), ``abs_pg`` ``max(|l1|, |l2|)``."""

    pg: torch.Tensor
    ratio: torch.Tensor
    ratio_clamped: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: Optional[torch.Tensor]
    abs_pg: torch.Tensor


# fn(logp, old_logp, advantages [B, T] or [B, 1], mask [B, T] float, *, clip_low, clip_high, dual_clip) -> PolicyTerms
POLICY_LOSSES = Registry()


def register_policy_loss(name: str):
    """Decorator: register a policy-loss surrogate under ``name`` (a ``--policy-loss`` choice); :func:`policy_loss`
    aggregates it and adds the KL, entropy and rollout-correction terms."""
    return POLICY_LOSSES.register(name)


def _clipped_surrogate(ratio, advantages, clip_low, clip_high, dual_clip) -> PolicyTerms:
    ratio_clamped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    l1 = -advantages * ratio
    l2 = -advantages * ratio_clamped
    pg = torch.maximum(l1, l2)
    dual_active = None
    if dual_clip is not None:
        l3 = -advantages * dual_clip
        dual_active = (advantages < 0) & (pg > l3)
        pg = torch.where(dual_active, l3, pg)
    with torch.no_grad():
        clipped, abs_pg = l2 > l1, torch.maximum(l1.abs(), l2.abs())
    return PolicyTerms(pg, ratio, ratio_clamped, clipped, dual_active, abs_pg)


@register_policy_loss("vanilla")
def vanilla_policy_terms(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip=None) -> PolicyTerms:
    """PPO's clipped surrogate on the token ratio (with dual clip when ``dual_clip`` is given)::

        r_t = exp(logp_t - old_logp_t)
        pg  = max(-A r_t, -A clip(r_t, 1 - clip_low, 1 + clip_high))
        pg  = min(pg, -A * dual_clip)   where A < 0           (dual-clip PPO, c > 1; optional)
    """
    return _clipped_surrogate(torch.exp(logp - old_logp), advantages, clip_low, clip_high, dual_clip)


@register_policy_loss("gspo")
def gspo_policy_terms(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip=None) -> PolicyTerms:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): the clipped surrogate on the SEQUENCE importance ratio, the
    geometric mean of the token ratios over the response (``mask``), in its GSPO-token form::

        s_i   = exp( sum_t m_t (logp_t - old_logp_t) / max(sum_t m_t, 1) )
        r_i,t = sg(s_i) * exp(logp_t - sg(logp_t))                  (value s_i; gradient s_i * grad logp_t)
        pg    = max(-A r_i,t, -A clip(r_i,t, 1 - clip_low, 1 + clip_high))

    With the same aggregation weight on every token of a response (every ``AGG_MODES`` mode) the loss and its
    gradient equal TRL 1.12 ``GRPOTrainer`` with ``importance_sampling_level="sequence"`` (whose ratio is the
    sequence's, differentiated through the mean); the paper's clip range is tiny (3e-4 / 4e-4,
    ``--gspo-clip-ratio`` / ``--gspo-clip-ratio-high``). No dual clip.
    """
    if dual_clip is not None:
        raise ValueError("gspo has no dual clip (--dual-clip applies to --policy-loss vanilla)")
    seq_log_ratio = (logp - old_logp) * mask
    seq_log_ratio = seq_log_ratio.sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    ratio = torch.exp(seq_log_ratio.detach() + (logp - logp.detach()))
    return _clipped_surrogate(ratio, advantages, clip_low, clip_high, None)


def rollout_is_weights(old_logp, rollout_logp, mode: str, threshold: float) -> torch.Tensor:
    """Per-token weights that correct for the rollout engine's sampling distribution (detached).

    ``w_t = exp(old_logp_t - rollout_logp_t)``: the training forward's probability of the sampled token over the
    sampler's. With ``C = threshold``:

    * ``tis`` (truncated IS): ``min(w_t, C)`` (TRL's ``vllm_importance_sampling_mode="token_truncate"``);
    * ``mis`` (masked IS): ``w_t`` where ``w_t <= C``, else 0: the token leaves the policy-gradient term (TRL's
      ``token_mask``); the aggregation's token / sequence counts keep it, as TRL's do.
    """
    with torch.no_grad():
        w = torch.exp(old_logp - rollout_logp)
        if mode == "tis":
            return w.clamp(max=threshold)
        if mode == "mis":
            return torch.where(w <= threshold, w, torch.zeros_like(w))
    raise ValueError(f"unknown rollout correction {mode!r}; valid modes are: tis, mis (or none)")


def _fused_kernel(device, *tensors) -> bool:
    """True when the fused loss kernel (``mindspeed_llm.kernels.triton_rl_losses``, ``MINDSPEED_LOSS_KERNEL``) is
    chosen for ``device`` and the given tensors (None: not used) are ``[B, T]`` of one shape."""
    if select_kernel("losses", device) != "triton":
        return False
    shape = tensors[0].shape
    return len(shape) == 2 and all(t is None or t.shape == shape for t in tensors[1:])


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
    loss_type="vanilla",
    max_len=None,
    ref_logp=None,
    kl_coef=0.0,
    kl_kind="low_var_kl",
    entropy=None,
    entropy_coeff=0.0,
    rollout_logp=None,
    rollout_is="none",
    rollout_is_threshold=2.0,
    total_tokens=None,
    total_sequences=None,
):
    """Clipped-surrogate policy loss (PPO / GRPO / DAPO / Dr. GRPO / GSPO) with optional KL and entropy terms.

    One function computes the loss and all its metrics from the same intermediates. Per token, with
    ``A`` the advantage (``[B, T]``, or ``[B]`` broadcast over tokens as in GRPO)::

        r        = exp(logp - old_logp)                                 (loss_type "vanilla"; "gspo": the
        l1       = -A * r                                                sequence ratio, gspo_policy_terms)
        l2       = -A * clip(r, 1 - clip_low, 1 + clip_high)           (clip_high None -> clip_low)
        pg       = max(l1, l2)                                          (PPO clipped surrogate)
        pg       = min(pg, -A * dual_clip)   where A < 0                (dual-clip PPO, c > 1; optional)
        pg       = pg * rollout_is_weights(old_logp, rollout_logp)      (only with rollout_is tis / mis)
        kl       = kl_penalty(logp, ref_logp, kl_kind)                  (only if kl_coef != 0)

        loss = agg(pg) + kl_coef * agg(kl) - entropy_coeff * token_mean(entropy)

    ``loss_type`` names the surrogate in ``POLICY_LOSSES`` (:func:`vanilla_policy_terms`,
    :func:`gspo_policy_terms`). ``rollout_is`` (``tis`` / ``mis``, threshold ``rollout_is_threshold``) weights the
    surrogate per token by :func:`rollout_is_weights`; it needs ``rollout_logp``, the sampler's log-probs, and
    ``old_logp`` from a training forward.

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
      ``entropy`` = token mean; always ``loss``;
    * with ``rollout_is``: ``rollout_is_weight`` = token mean of the weights, ``rollout_is_clipfrac`` = fraction
      of tokens with ``w > threshold`` (truncated by tis, masked by mis).

    On CUDA / Ascend (``MINDSPEED_LOSS_KERNEL``, module docstring) the surrogates ``vanilla`` and ``gspo`` run
    fused: the same loss, metrics and gradients in one kernel launch (a surrogate registered elsewhere runs here).

    Returns:
        ``(loss, metrics)``.
    """
    if clip_high is None:
        clip_high = clip_low
    surrogate = _checked_surrogate(loss_type, dual_clip, rollout_is, rollout_logp, kl_coef, ref_logp, entropy,
                                   entropy_coeff)
    if advantages.dim() == logp.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    if _runs_fused(surrogate, loss_type, dual_clip, rollout_is, kl_coef, kl_kind, advantages, logp, old_logp,
                   response_mask, ref_logp, entropy, rollout_logp):
        return _fused_policy_loss(logp, old_logp, advantages, response_mask, clip_low, clip_high, dual_clip, agg,
                                  loss_type, max_len, ref_logp, kl_coef, kl_kind, entropy, entropy_coeff, rollout_logp,
                                  rollout_is, rollout_is_threshold, total_tokens, total_sequences)
    mask = response_mask.to(logp.dtype)
    loss_w = aggregation_weights(mask, agg, max_len, total_tokens=total_tokens, total_sequences=total_sequences)
    token_w = aggregation_weights(mask, "token-mean", total_tokens=total_tokens)

    def token_mean(x):
        return (x * token_w).sum()

    log_ratio = logp - old_logp
    terms = surrogate(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    pg = terms.pg
    if rollout_is != "none":
        is_weights = rollout_is_weights(old_logp, rollout_logp, rollout_is, rollout_is_threshold)
        pg = pg * is_weights
    pg_loss = (pg * loss_w).sum()
    loss = pg_loss

    metrics = _surrogate_metrics(terms, pg_loss, log_ratio, mask, token_mean,
                                 is_weights if rollout_is != "none" else None, old_logp, rollout_logp,
                                 rollout_is_threshold)

    loss = _with_kl_and_entropy(loss, metrics, logp, ref_logp, kl_coef, kl_kind, loss_w, token_mean, entropy,
                                entropy_coeff)
    metrics["loss"] = loss.detach()
    return loss, metrics


def _with_kl_and_entropy(loss, metrics, logp, ref_logp, kl_coef, kl_kind, loss_w, token_mean, entropy,
                         entropy_coeff):
    """`policy_loss`'s `loss` with its KL term (kl_coef != 0) and entropy bonus, their metrics added to `metrics`."""
    if kl_coef != 0.0:
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
    return loss


def _runs_fused(surrogate, loss_type, dual_clip, rollout_is, kl_coef, kl_kind, advantages, logp, old_logp,
                response_mask, ref_logp, entropy, rollout_logp) -> bool:
    """Whether `policy_loss` runs its fused kernel: a built-in surrogate (not gspo with a dual clip), a rollout_is
    mode and KL estimator the kernel has, per-token or per-row advantages, and a kernel for these tensors."""
    builtin = {"vanilla": vanilla_policy_terms, "gspo": gspo_policy_terms}.get(loss_type)
    return bool(surrogate is builtin and not (loss_type == "gspo" and dual_clip is not None)
                and rollout_is in ROLLOUT_IS_MODES and (kl_coef == 0.0 or kl_kind in KL_KINDS)
                and advantages.dim() == 2 and advantages.shape[-1] in (1, logp.shape[-1])
                and advantages.shape[0] == logp.shape[0]
                and _fused_kernel(logp.device, logp, old_logp, response_mask, ref_logp if kl_coef != 0.0 else None,
                                  entropy, rollout_logp if rollout_is != "none" else None))


def _checked_surrogate(loss_type, dual_clip, rollout_is, rollout_logp, kl_coef, ref_logp, entropy, entropy_coeff):
    """`policy_loss`'s argument checks; the surrogate named `loss_type` (`POLICY_LOSSES`)."""
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1.0 (got {dual_clip})")
    surrogate = POLICY_LOSSES.get(loss_type)
    if surrogate is None:
        raise ValueError(f"unknown policy loss {loss_type!r}; valid names are: {', '.join(POLICY_LOSSES)}")
    if rollout_is != "none" and rollout_logp is None:
        raise ValueError(f"policy_loss: rollout_is={rollout_is!r} needs rollout_logp (the sampler's log-probs)")
    if kl_coef != 0.0 and ref_logp is None:
        raise ValueError("policy_loss: kl_coef != 0 needs ref_logp")
    if entropy is None and entropy_coeff != 0.0:
        raise ValueError("policy_loss: entropy_coeff != 0 needs entropy")
    return surrogate


def _surrogate_metrics(terms: PolicyTerms, pg_loss, log_ratio, mask, token_mean, is_weights, old_logp, rollout_logp,
                       rollout_is_threshold) -> Dict[str, torch.Tensor]:
    """`policy_loss`'s metrics of the surrogate (its docstring), detached; `is_weights` None without rollout_is."""
    with torch.no_grad():
        metrics = {
            "pg_loss": pg_loss.detach(),
            "pg_clipfrac": token_mean(terms.clipped.to(mask.dtype)),
            "pg_clipfrac_lower": (
                token_mean(terms.dual_clipped.to(mask.dtype))
                if terms.dual_clipped is not None
                else torch.zeros((), dtype=mask.dtype, device=mask.device)
            ),
            "ppo_kl": token_mean(-log_ratio),
            "approx_kl": token_mean(0.5 * log_ratio.square()),
            "ppo_ratio": token_mean(terms.ratio),
            "ppo_ratio_clamped": token_mean(terms.ratio_clamped),
            "abs_pg_loss": token_mean(terms.abs_pg),
        }
        if is_weights is not None:
            metrics["rollout_is_weight"] = token_mean(is_weights)
            metrics["rollout_is_clipfrac"] = token_mean(
                (torch.exp(old_logp - rollout_logp) > rollout_is_threshold).to(mask.dtype))
    return metrics


def _fused_policy_loss(logp, old_logp, advantages, response_mask, clip_low, clip_high, dual_clip, agg, loss_type,
                       max_len, ref_logp, kl_coef, kl_kind, entropy, entropy_coeff, rollout_logp, rollout_is,
                       rollout_is_threshold, total_tokens, total_sequences):
    """:func:`policy_loss` through the fused kernel (validated arguments): the aggregation's denominators and
    GSPO's sequence ratio here, the rest in the kernel."""
    from mindspeed_llm.kernels.triton_rl_losses import fused_policy_loss

    sequence_log_ratio = None
    if loss_type == "gspo":  # the detached row mean of the log-ratio, as gspo_policy_terms
        mask = response_mask.to(logp.dtype)
        sequence_log_ratio = ((logp.detach() - old_logp) * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    return fused_policy_loss(
        logp, old_logp, advantages, response_mask,
        aggregation_denominator(response_mask, agg, max_len, total_tokens=total_tokens,
                                total_sequences=total_sequences),
        aggregation_denominator(response_mask, "token-mean", total_tokens=total_tokens),
        clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, sequence_log_ratio=sequence_log_ratio,
        ref_logp=ref_logp, kl_coef=kl_coef, kl_kind=kl_kind, entropy=entropy, entropy_coeff=entropy_coeff,
        rollout_logp=rollout_logp, rollout_is=rollout_is, rollout_is_threshold=rollout_is_threshold,
        k3_bounds=(K3_LOG_RATIO_BOUND, K3_VALUE_BOUND),
    )


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
    ``vpred`` = masked mean of ``values``, ``returns`` = masked mean of ``returns``. On CUDA / Ascend it runs fused
    (``MINDSPEED_LOSS_KERNEL``, module docstring) for ``[B, T]`` inputs.
    """
    if _fused_kernel(values.device, values, old_values, returns, value_mask):
        from mindspeed_llm.kernels.triton_rl_losses import fused_value_loss

        return fused_value_loss(values, old_values, returns, value_mask, cliprange_value,
                                aggregation_denominator(value_mask, "token-mean", total_tokens=total_tokens))
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
