"""Advantage estimators by name (``--adv-estimator``): the registry ``ADV_ESTIMATORS`` and the critic-free
estimators. GAE, the critic's estimator, lives with the PPO token rewards (:mod:`.rewards`) and is registered
there.

Three kinds of estimator, by what they take (each kind has one call convention, which the stages follow):

* ``"outcome"``: ``fn(scores [B], group_size, *, scale=<its own default>, sum_across=None) -> [B]``, one advantage
  per sample, broadcast over its response by the caller (GRPO, Dr. GRPO, RLOO). ``scores`` hold a prompt's
  ``group_size`` samples contiguously.
* ``"token"``: ``fn(token_rewards [B, T], response_mask [B, T], group_size, *, gamma, sum_across=None) -> [B, T]``,
  advantages per token, zero outside ``response_mask`` (REINFORCE++ and its group-baseline variant).
  ``token_rewards`` are :func:`~.rewards.compute_token_rewards` with ``score_at="last"`` (the score on the last
  response token, verl's placement), with the ``-kl_coef * KL`` penalty on every token when the estimator is
  registered ``kl_in_reward`` (else ``kl_coef = 0``).
* ``"critic"``: :func:`~.rewards.compute_gae`'s signature, ``fn(token_rewards, values, response_mask, gamma, lam, *,
  whiten, value_mask, sum_across) -> (advantages, returns)``, with TRL's reward placement (GAE).

Every batch statistic takes ``sum_across`` (package docstring, "Global statistics"); groups never span shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mindspeed_llm.registry import Registry
from mindspeed_llm.rl.core_algos.scans import discounted_returns
from mindspeed_llm.rl.core_algos.stats import SumAcross, _nanstd, masked_whiten

GROUP_SCALES = ("group", "batch", "none")
ADV_KINDS = ("outcome", "token", "critic")


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    fn: Callable
    kind: str  # one of ADV_KINDS: the call convention (module docstring)
    kl_in_reward: bool = False  # token / critic kinds: the KL penalty is part of the token rewards


ADV_ESTIMATORS = Registry()  # name -> AdvantageEstimator


def register_advantage(name: str, kind: str = "outcome", *, kl_in_reward: bool = False):
    """Decorator: register an advantage estimator under ``name`` (a ``--adv-estimator`` choice). ``kind`` is its call
    convention (module docstring): ``outcome`` and ``token`` estimators serve the critic-free stage (grpo),
    ``critic`` ones the stage with a critic (trl_ppo)."""
    if kind not in ADV_KINDS:
        raise ValueError(f"unknown advantage estimator kind {kind!r}; valid kinds are: {', '.join(ADV_KINDS)}")

    def register(fn):
        ADV_ESTIMATORS[name] = AdvantageEstimator(name, fn, kind, kl_in_reward)
        return fn
    return register


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


# ----------------------------------------------------------------------------------------------------
# Outcome estimators: one score per sample -> one advantage per sample
# ----------------------------------------------------------------------------------------------------
@register_advantage("grpo")
def grpo_advantages(scores: torch.Tensor, group_size: int, *, scale: str = "group",
                    sum_across: SumAcross = None) -> torch.Tensor:
    """GRPO's group-normalised advantages: :func:`group_advantages`."""
    return group_advantages(scores, group_size, scale=scale, sum_across=sum_across)


@register_advantage("rloo")
def rloo_advantages(scores: torch.Tensor, group_size: int, *, scale: str = "none",
                    sum_across: SumAcross = None) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv:2402.14740): each sample's baseline is the mean
    score of the OTHER samples of its prompt, ``A_i = s_i - mean_{j != i} s_j = n / (n - 1) * (s_i - mu_g)``
    (``n`` the group's scored samples). No std scaling (``scale`` must be ``"none"``); NaN scores are left out
    and get 0, and a group of one has no baseline (0). TRL 1.12 ``RLOOTrainer`` with ``beta=0`` and
    ``normalize_advantages=False``."""
    if scale != "none":
        raise ValueError(f"rloo advantages are not scaled by a std: --adv-scale {scale} does not apply (use none)")
    grouped = (scores if scores.is_floating_point() else scores.float()).view(-1, group_size)
    count = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    others = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, grouped - others, torch.zeros_like(grouped))
    return torch.nan_to_num(adv, nan=0.0).reshape(-1)


@register_advantage("dr_grpo")
def dr_grpo_advantages(scores: torch.Tensor, group_size: int, *, scale: str = "none",
                       sum_across: SumAcross = None) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): the group mean as baseline and NO std scaling,
    ``A_i = s_i - mu_g`` (verl's ``norm_adv_by_std_in_grpo=False``, TRL's ``scale_rewards="none"``). The paper pairs
    it with a length-independent loss (``--loss-agg-mode seq-mean-token-sum-norm``). ``scale`` must be ``"none"``;
    NaN scores as in :func:`group_advantages`."""
    if scale != "none":
        raise ValueError(f"dr_grpo advantages are not scaled by a std: --adv-scale {scale} does not apply (use none, "
                         "or --adv-estimator grpo for a scaled one)")
    return group_advantages(scores, group_size, scale="none", sum_across=sum_across)


# ----------------------------------------------------------------------------------------------------
# Token estimators: token rewards -> advantages per token (REINFORCE++, Hu 2025, arXiv:2501.03262)
# ----------------------------------------------------------------------------------------------------
@register_advantage("reinforce_plus_plus", kind="token", kl_in_reward=True)
def reinforce_plus_plus_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor, group_size: int = 1, *,
                                   gamma: float = 1.0, sum_across: SumAcross = None) -> torch.Tensor:
    """REINFORCE++: discounted returns of the token rewards, whitened over the whole batch (verl's
    ``compute_reinforce_plus_plus_outcome_advantage``).

    With ``r_t`` the token rewards (the score on the last response token minus ``kl_coef * KL_t`` on every token,
    the KL of the policy that sampled to the reference) and ``m`` the response mask::

        G_t = r_t + gamma * m_{t+1} * G_{t+1}          (G_T = 0: the return stops at the response's end)
        A   = (G - mean(G)) / sqrt(var(G) + 1e-8) * m   (masked_whiten over every response token of the batch)

    No baseline per prompt (``group_size`` unused); mean and (unbiased) variance are over all shards with
    ``sum_across``. ``G`` is :func:`~.scans.discounted_returns` (a scan; verl's loop within fp32 rounding).
    Returns ``A`` ``[B, T]``.
    """
    mask = response_mask.to(token_rewards.dtype)
    returns = discounted_returns(token_rewards, mask, gamma)  # a scan, no Python loop over T (.scans)
    return masked_whiten(returns, mask, sum_across=sum_across) * mask


@register_advantage("reinforce_plus_plus_baseline", kind="token")
def reinforce_plus_plus_baseline_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor,
                                            group_size: int, *, gamma: float = 1.0,
                                            sum_across: SumAcross = None) -> torch.Tensor:
    """REINFORCE++ with a group baseline (verl's ``compute_reinforce_plus_plus_baseline_outcome_advantage``): the
    score less its group's mean, on every response token, then whitened over the batch's response tokens.

    With ``s_i = sum_t r_{i,t}`` (the score; its KL penalty goes in the loss, ``--kl-coef``), ``mu_g`` the mean
    score of its group of ``group_size`` (0 for a group of one, as verl) and ``m`` the response mask::

        a_{i,t} = (s_i - mu_g) * m_{i,t}
        A       = (a - mean(a)) / sqrt(var(a) + 1e-8) * m   (masked_whiten: a token-weighted batch statistic)

    ``gamma`` is unused (the advantage is the same on every token of a response). Mean and variance are over all
    shards with ``sum_across``; groups never span shards. Returns ``A`` ``[B, T]``.
    """
    mask = response_mask.to(token_rewards.dtype)
    grouped = token_rewards.sum(dim=-1).view(-1, group_size)
    baseline = grouped.mean(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(grouped)
    centred = (grouped - baseline).reshape(-1, 1) * mask
    return masked_whiten(centred, mask, sum_across=sum_across) * mask
