"""PPO token rewards and GAE: the response / value masks, the per-token rewards (KL penalty plus the score once),
generalized advantage estimation with TRL's reverse recursion, as a scan (``--adv-estimator gae``, the critic's), and
DAPO's overlong penalty."""

from __future__ import annotations

import torch

from mindspeed_llm.rl.core_algos.advantages import register_advantage
from mindspeed_llm.rl.core_algos.kl import kl_penalty
from mindspeed_llm.rl.core_algos.scans import gae_scan
from mindspeed_llm.rl.core_algos.stats import SumAcross, masked_whiten


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


def critic_mask(loss_mask: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Where the critic's value loss is taken (bool): TRL's value mask (:func:`response_mask_p1`) of the loss mask,
    less the rows whose response the loss mask took out whole (e.g. ``--mask-truncated-completions``); an empty
    response keeps TRL's one position."""
    kept = loss_mask.bool().any(-1) | ~response_mask.bool().any(-1)
    return response_mask_p1(loss_mask) & kept.unsqueeze(-1)


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


@register_advantage("gae", kind="critic", kl_in_reward=True)
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
    positions contribute nothing. It runs as a scan (:func:`~.scans.gae_scan`: log-depth in torch, one Triton
    launch on CUDA / Ascend), equal to TRL's reverse loop within fp32 rounding (:mod:`.scans`).

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
        sum_across: sums a tensor over the batch's shards (package docstring), for the whitening.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``.
    """
    if value_mask is None:
        value_mask = response_mask_p1(response_mask)
    advantages, returns = gae_scan(rewards, values, value_mask, gamma, lam)  # no Python loop over T (.scans)
    if whiten:
        advantages = masked_whiten(advantages, response_mask, sum_across=sum_across)
    advantages = advantages * response_mask.to(advantages.dtype)
    return advantages, returns


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), added to the score.

    For a response of ``n`` tokens, with ``M = max_len`` (``--max-new-tokens``), ``L = buffer_len`` and ``F = factor``::

        penalty(n) = min(0, (M - L - n) / L) * F

    0 up to ``M - L`` tokens, then falling linearly to ``-F`` at ``n = M`` (verl's ``overlong_buffer``). ``lengths``
    ``[B]``; returns ``[B]`` float.
    """
    if buffer_len < 1:
        raise ValueError(f"overlong buffer length must be >= 1 (got {buffer_len})")
    n = lengths.to(torch.float32)
    return torch.clamp((max_len - buffer_len - n) / buffer_len, max=0.0) * factor
