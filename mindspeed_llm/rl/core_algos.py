"""Pure tensor math for RL post-training (TRL-style PPO and GRPO).

Everything here is a plain function of tensors: torch only, no distributed code, no I/O, no global
state. Each docstring states the formula it implements so it can be read next to the paper.

Conventions used throughout
---------------------------
* Tensors are ``[batch, response_len]`` ("B x T"); position ``t`` of row ``b`` is the ``t``-th generated
  token of response ``b``. Responses are right padded.
* ``response_mask`` is 1 (or True) for real response tokens (up to and including EOS) and 0 for padding.
  It is TRL's ``~padding_mask``. Masks may be bool or float; float masks act as per-token weights
  where that makes sense (means, losses).
* ``value_mask`` is the mask of positions where the critic's values (and the PPO rewards) live. TRL
  places the scalar score one position *after* the last response token (see
  :func:`compute_token_rewards`), so its value mask is the response mask extended by that one position
  (TRL's ``~padding_mask_p1``); :func:`response_mask_p1` builds it.
* Loss functions return ``(loss, metrics)`` where ``loss`` is a differentiable 0-d tensor and
  ``metrics`` is a dict of detached 0-d tensors (no host sync is forced here; call ``.item()`` when
  logging).
* Global statistics. A batch may be split into micro-batches and data-parallel shards. Every mean here can
  take the totals of the whole (mini-)batch: the losses take ``total_tokens`` / ``total_sequences`` (then a
  micro-batch's loss is its SHARE of the batch's loss, and the shares add up to it, whatever the split),
  and the statistics (whitening, the batch std) take ``sum_across``, a function that sums a tensor over
  the shards (an all-reduce; identity when absent). The math stays here; the communication is the caller's.

References: PPO (Schulman et al. 2017, arXiv:1707.06347); GAE (Schulman et al. 2015,
arXiv:1506.02438); dual-clip PPO (Ye et al. 2020, arXiv:1912.09729); GRPO (Shao et al. 2024,
arXiv:2402.03300); DAPO (Yu et al. 2025, arXiv:2503.14476); Dr. GRPO (Liu et al. 2025,
arXiv:2503.20783); RLOO (Ahmadian et al. 2024, arXiv:2402.14740); KL estimators k1/k2/k3 (J. Schulman,
"Approximating KL divergence", 2020).
Behaviour is matched to Hugging Face TRL 1.12.0 where TRL has the same quantity (see
tests/test_trl_parity.py).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

# sum_across(t) -> t summed over every shard of the batch (e.g. an all-reduce over data-parallel ranks).
SumAcross = Optional[Callable[[torch.Tensor], torch.Tensor]]

__all__ = [
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "KL_KINDS",
    "kl_penalty",
    "last_response_index",
    "response_mask_p1",
    "compute_token_rewards",
    "compute_gae",
    "AGG_MODES",
    "aggregation_weights",
    "aggregate_loss",
    "policy_loss",
    "value_loss",
    "GROUP_SCALES",
    "group_advantages",
    "OUTCOME_ADVANTAGES",
    "register_outcome_advantage",
    "grpo_advantages",
    "rloo_advantages",
]

KL_KINDS = ("k1", "k2", "k3", "low_var_kl", "abs")
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
GROUP_SCALES = ("group", "batch", "none")

# Bounds used by the k3 / low_var_kl estimator (as in verl and MindSpeed-RL): the log-ratio is clamped
# before exp() so it cannot overflow, and the estimate itself is clamped to [-10, 10].
_K3_LOG_RATIO_BOUND = 20.0
_K3_VALUE_BOUND = 10.0


# ----------------------------------------------------------------------------------------------------
# Masked statistics (same semantics as TRL's helpers of the same names)
# ----------------------------------------------------------------------------------------------------
def _sums(values, sum_across: SumAcross):
    """The partial sums in ``values`` (0-d tensors), summed over the shards when ``sum_across`` is given."""
    if sum_across is None:
        return values
    return tuple(sum_across(torch.stack(values)).unbind())


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None, sum_across: SumAcross = None) -> torch.Tensor:
    """Mean of ``x`` over the positions selected by ``mask``.

    ``masked_mean(x, m) = sum(x * m) / sum(m)`` (over ``dim`` when given, else over all elements; with
    ``sum_across`` both sums run over every shard of the batch).

    Same semantics as TRL's ``masked_mean``: no clamping, so an all-zero mask gives NaN.
    """
    if dim is not None:
        return (x * mask).sum(dim=dim) / mask.sum(dim=dim)
    if sum_across is None:
        return (x * mask).sum() / mask.sum()
    mask = mask.to(x.dtype)
    total, count = _sums(((x * mask).sum(), mask.sum()), sum_across)
    return total / count


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, sum_across: SumAcross = None) -> torch.Tensor:
    """Variance of ``x`` over the masked positions (all dimensions; all shards with ``sum_across``).

    ``mu = masked_mean(x, m)``, ``var = masked_mean((x - mu)^2, m)``; with ``unbiased`` the Bessel
    correction ``n / (n - 1)`` is applied, ``n = sum(m)``.

    Raises ``ValueError`` when ``unbiased`` and ``sum(m) == 0`` (as TRL does). ``n == 1`` divides by
    zero (inf), also as in TRL.
    """
    mean = masked_mean(x, mask, sum_across=sum_across)
    var = masked_mean((x - mean) ** 2, mask, sum_across=sum_across)
    if unbiased:
        (n,) = _sums((mask.sum().to(var.dtype),), sum_across)
        if n == 0:
            raise ValueError(
                "masked_var: the mask selects no element, so the unbiased variance is undefined "
                "(use a larger mini-batch)"
            )
        var = var * (n / (n - 1))
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, sum_across: SumAcross = None) -> torch.Tensor:
    """Whiten ``x`` with masked statistics (of every shard, with ``sum_across``).

    ``(x - mu) / sqrt(var + 1e-8)`` with ``mu``, ``var`` = :func:`masked_mean`, :func:`masked_var`
    (unbiased). With ``shift_mean=False`` the mean is added back: ``(x - mu) / sqrt(var + 1e-8) + mu``.
    Every position is transformed (masked-out ones too); callers zero them if needed.
    """
    mean = masked_mean(x, mask, sum_across=sum_across)
    var = masked_var(x, mask, sum_across=sum_across)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out


# ----------------------------------------------------------------------------------------------------
# KL estimators and PPO rewards
# ----------------------------------------------------------------------------------------------------
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


def last_response_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real response token of each row (``-1`` for an empty response).

    For the usual right-padded mask this is ``sum(mask) - 1``, i.e. TRL's ``sequence_lengths``
    (``first_true_indices(response == pad) - 1``). Shape ``[B]``, dtype long.
    """
    valid = response_mask.bool()
    length = valid.size(-1)
    # argmax on the flipped mask finds the first True from the right; rows with no True give 0.
    from_right = valid.flip(-1).to(torch.uint8).argmax(dim=-1)
    last = (length - 1) - from_right
    return torch.where(valid.any(dim=-1), last, torch.full_like(last, -1))


def response_mask_p1(response_mask: torch.Tensor) -> torch.Tensor:
    """The response mask extended by one position after the last response token (bool).

    This is TRL's ``~padding_mask_p1``: for a right-padded response whose last real token is at
    ``s = last_response_index(mask)``, positions ``t <= s + 1`` are selected (``s + 1`` only when it is
    inside the tensor). It is where TRL's PPO keeps critic values, places the score (see
    :func:`compute_token_rewards`) and computes the value loss.
    """
    valid = response_mask.bool()
    nxt = last_response_index(response_mask) + 1  # in [0, T]
    idx = torch.arange(valid.size(-1), device=valid.device)
    return valid | (idx.unsqueeze(0) == nxt.unsqueeze(-1))


def compute_token_rewards(scores, logp, ref_logp, response_mask, kl_coef, kind="k1", score_at="after_last"):
    """Per-token PPO rewards: a KL penalty on every response token plus the scalar score once.

    ``kl[b, t] = kl_penalty(logp, ref_logp, kind)[b, t] * response_mask[b, t]``

    ``rewards[b, t] = -kl_coef * kl[b, t] + scores[b] * [t == e_b]``

    Score placement ``e_b`` (``s_b`` = :func:`last_response_index`, the index of the last real
    response token, i.e. EOS when the response has one; ``T`` = ``rewards.size(1)``):

    * ``score_at="after_last"`` (default, TRL 1.12 ``PPOTrainer.train``):
      ``e_b = s_b + 1 if s_b + 1 < T else s_b``. TRL computes
      ``sequence_lengths = first_true_indices(response == pad) - 1`` (= ``s_b``),
      ``actual_end = where(sequence_lengths + 1 < T, sequence_lengths + 1, sequence_lengths)`` and does
      ``rewards[arange(B), actual_end] += scores``. So when a row has room, the score lands on the
      first padding position (one past EOS) -- outside ``response_mask`` but inside the value mask
      :func:`response_mask_p1`; a row that fills the tensor (no padding, e.g. truncated at
      ``response_length`` without EOS) gets it on its last token. An empty response (``s_b = -1``)
      gets it at position 0.
    * ``score_at="last"``: ``e_b = s_b`` (the score on the last real token; verl / OpenRLHF style).
      Empty rows get no score.

    Masking: TRL fills ``logp`` and ``ref_logp`` with ``INVALID_LOGPROB`` (1.0) on padding, which makes
    every estimator 0 there; multiplying the KL by ``response_mask`` gives the identical tensor.

    The rewards are non-zero only inside the value mask, which is what :func:`compute_gae` needs:
    pair the default placement with ``value_mask=response_mask_p1(response_mask)`` (compute_gae's
    default) and ``"last"`` with ``value_mask=response_mask``. TRL's optional reward whitening is
    ``masked_whiten(rewards, value_mask, shift_mean=False) * value_mask``.

    Args:
        scores: ``[B]`` scalar reward-model scores (any EOS penalty already applied).
        logp, ref_logp: ``[B, T]`` log-probs of the sampled tokens under the policy / reference.
        response_mask: ``[B, T]`` 1 for real response tokens.
        kl_coef: KL coefficient (float or 0-d tensor).
        kind: KL estimator, see :func:`kl_penalty`.
        score_at: ``"after_last"`` (TRL) or ``"last"``.

    Returns:
        ``(rewards, kl)``, both ``[B, T]``; ``kl`` is the masked per-token estimate.
    """
    mask = response_mask.to(logp.dtype)
    kl = kl_penalty(logp, ref_logp, kind) * mask
    rewards = -kl_coef * kl
    last = last_response_index(response_mask)
    length = rewards.size(1)
    rows = torch.arange(rewards.size(0), device=rewards.device)
    if score_at == "after_last":
        end = torch.where(last + 1 < length, last + 1, last)
        rewards = rewards.index_put((rows, end), scores.to(rewards.dtype), accumulate=True)
    elif score_at == "last":
        has = last >= 0
        rewards = rewards.index_put(
            (rows[has], last[has]), scores.to(rewards.dtype)[has], accumulate=True
        )
    else:
        raise ValueError(f"unknown score_at {score_at!r}; valid values are: after_last, last")
    return rewards, kl


def compute_gae(rewards, values, response_mask, gamma, lam, whiten=True, value_mask=None,
                sum_across: SumAcross = None):
    """Generalized advantage estimation with TRL's reverse loop, then (optionally) whitening.

    With ``V = values * value_mask`` (values outside the value mask are zeroed, as TRL does with
    ``padding_mask_p1``) and ``V[:, T] = 0``::

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}          (A_T = 0, loop t = T-1 .. 0)
        R_t     = A_t + V_t                                 (returns, from the raw advantages)

    The recursion runs over every position, exactly as TRL 1.12 ``PPOTrainer.train``; the rewards
    from :func:`compute_token_rewards` and the masked values are zero beyond the value mask, so those
    positions contribute nothing.

    Then, when ``whiten`` (TRL always whitens): ``A = masked_whiten(A, response_mask)`` (mean shifted,
    unbiased variance; statistics of the whole batch with ``sum_across``). Finally advantages are zeroed outside ``response_mask`` (whitened or not).
    Returns are not whitened and not re-masked (they are 0 beyond the value mask by construction).

    Args:
        rewards: ``[B, T]`` per-token rewards (:func:`compute_token_rewards`).
        values: ``[B, T]`` critic values for each position.
        response_mask: ``[B, T]`` 1 for real response tokens: the mask for whitening and for the
            advantages that are returned.
        gamma, lam: discount and GAE lambda.
        whiten: whiten advantages over ``response_mask`` (TRL behaviour).
        value_mask: where values are defined; default :func:`response_mask_p1` ``(response_mask)``,
            TRL's convention matching the default score placement.
        sum_across: sums a tensor over the batch's shards (module docstring), for the whitening.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``.
    """
    if value_mask is None:
        value_mask = response_mask_p1(response_mask)
    values = values * value_mask.to(values.dtype)
    length = rewards.size(1)
    last_gae = torch.zeros_like(rewards[:, 0])
    reversed_adv = []
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = delta + gamma * lam * last_gae
        reversed_adv.append(last_gae)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    returns = advantages + values
    if whiten:
        advantages = masked_whiten(advantages, response_mask, sum_across=sum_across)
    advantages = advantages * response_mask.to(advantages.dtype)
    return advantages, returns


# ----------------------------------------------------------------------------------------------------
# Loss aggregation and losses
# ----------------------------------------------------------------------------------------------------
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
    * ``ratio``: ``mean(r)``; ``ratio_clamped``: ``mean(clip(r))`` (MindSpeed ``ppo_ratio(_clamped)``);
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
            "ratio": token_mean(ratio),
            "ratio_clamped": token_mean(ratio_clamped),
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


# ----------------------------------------------------------------------------------------------------
# GRPO advantages
# ----------------------------------------------------------------------------------------------------
def group_advantages(scores: torch.Tensor, group_size: int, eps: float = 1e-6, scale: str = "group",
                     sum_across: SumAcross = None) -> torch.Tensor:
    """Group-relative (outcome) advantages for GRPO, one per sample.

    ``scores`` is ``[num_prompts * group_size]`` with the ``group_size`` samples of a prompt contiguous.
    With ``mu_g`` the mean of the sample's group::

        group: A_i = (s_i - mu_g) / (std_g + eps)       (GRPO; std unbiased, as TRL's nanstd)
        batch: A_i = (s_i - mu_g) / (std_batch + eps)   (TRL scale_rewards="batch": group mean,
                                                          std over the whole batch)
        none:  A_i =  s_i - mu_g                         (Dr. GRPO: no std scaling)

    A std over a single element is taken as 0 (TRL does the same when ``num_generations == 1``).
    Groups never span shards; with ``sum_across`` the ``batch`` std is that of every shard's scores.
    NaN scores (unscorable samples) are left out of the means and stds and get advantage 0, as in
    TRL. TRL's default ``eps`` is 1e-4.

    Returns a ``[num_prompts * group_size]`` tensor of the scores' floating dtype.
    """
    if scale not in GROUP_SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; valid scales are: {', '.join(GROUP_SCALES)}")
    if group_size < 1 or scores.dim() != 1 or scores.numel() % group_size != 0:
        raise ValueError(
            f"scores must be 1-D with a length divisible by group_size (got shape {tuple(scores.shape)}, "
            f"group_size={group_size})"
        )
    if not scores.is_floating_point():
        scores = scores.float()
    grouped = scores.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    adv = (grouped - mean).reshape(-1)
    if scale == "group":
        std = _nanstd(grouped, dim=1).repeat_interleave(group_size)
        adv = adv / (std + eps)
    elif scale == "batch":
        adv = adv / (_nanstd(scores, dim=0, sum_across=sum_across) + eps)
    return torch.nan_to_num(adv, nan=0.0)


def _nanstd(x: torch.Tensor, dim: int, sum_across: SumAcross = None) -> torch.Tensor:
    """Unbiased std over ``dim`` ignoring NaNs; 0 where fewer than two values are present. ``sum_across``
    (1-D ``x`` only) takes the std over every shard."""
    present = ~torch.isnan(x)
    if sum_across is None:
        mean = torch.nanmean(x, dim=dim, keepdim=True)
        count = present.sum(dim=dim)
        sq = torch.nansum((x - mean) ** 2, dim=dim)
    else:
        total, count = _sums((torch.nansum(x), present.sum().to(x.dtype)), sum_across)
        mean = total / count
        (sq,) = _sums((torch.nansum((x - mean) ** 2),), sum_across)
    var = sq / (count - 1).clamp(min=1)
    return torch.where(count > 1, var.sqrt(), torch.zeros_like(var))


# ----------------------------------------------------------------------------------------------------
# Outcome advantage estimators: one score per sample -> one advantage per sample, by name
# ----------------------------------------------------------------------------------------------------
# fn(scores [num_prompts * group_size], group_size, *, scale, sum_across) -> advantages of the same shape.
OUTCOME_ADVANTAGES: Dict[str, Callable[..., torch.Tensor]] = {}


def register_outcome_advantage(name: str):
    """Decorator: register an outcome advantage estimator under `name` (`--adv-estimator NAME`)."""
    def register(fn):
        OUTCOME_ADVANTAGES[name] = fn
        return fn
    return register


@register_outcome_advantage("grpo")
def grpo_advantages(scores: torch.Tensor, group_size: int, *, scale: str = "group",
                    sum_across: SumAcross = None) -> torch.Tensor:
    """GRPO's group-normalised advantages: :func:`group_advantages`."""
    return group_advantages(scores, group_size, scale=scale, sum_across=sum_across)


@register_outcome_advantage("rloo")
def rloo_advantages(scores: torch.Tensor, group_size: int, *, scale: str = "none",
                    sum_across: SumAcross = None) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv:2402.14740): each sample's baseline is the mean
    score of the OTHER samples of its prompt, ``A_i = s_i - mean_{j != i} s_j = n / (n - 1) * (s_i - mu_g)``
    (``n`` the group's scored samples). No std scaling (``scale`` must be ``"none"``); NaN scores are left out
    and get 0, and a group of one has no baseline (0)."""
    if scale != "none":
        raise ValueError(f"rloo advantages are not scaled by a std: --adv-scale {scale} does not apply (use none)")
    grouped = (scores if scores.is_floating_point() else scores.float()).view(-1, group_size)
    count = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    others = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, grouped - others, torch.zeros_like(grouped))
    return torch.nan_to_num(adv, nan=0.0).reshape(-1)
