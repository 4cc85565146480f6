"""Outcome advantages: one score per sample -> one advantage per sample. GRPO's group-relative advantages
(:func:`group_advantages`) and the estimators by name (``OUTCOME_ADVANTAGES``, ``--adv-estimator``)."""

from __future__ import annotations

from typing import Callable, Dict

import torch

from mindspeed_llm.rl.core_algos.stats import SumAcross, _nanstd

GROUP_SCALES = ("group", "batch", "none")


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
