"""Masked statistics (same semantics as TRL's helpers of the same names) and the NaN-ignoring std of the
outcome advantages; every one can take ``sum_across`` to run over all the shards of a batch (package docstring,
"Global statistics")."""

from __future__ import annotations

from typing import Callable, Optional

import torch

# sum_across(t) -> t summed over every shard of the batch (e.g. an all-reduce over data-parallel ranks).
SumAcross = Optional[Callable[[torch.Tensor], torch.Tensor]]


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
