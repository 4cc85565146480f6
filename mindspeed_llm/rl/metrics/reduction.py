"""Scalar metrics reduced over the data-parallel ranks in one collective, each key with its own operation."""

from __future__ import annotations

import zlib
from typing import Dict, Mapping


def _key_op(key: str) -> str:
    if key.endswith("/failures"):  # counts: the job's total
        return "sum"
    if key.endswith(("/max", "_max")):
        return "max"
    if key.endswith(("/min", "_min")):
        return "min"
    return "mean"


def reduce_metrics(metrics: Mapping[str, float], group=None, device="cpu") -> Dict[str, float]:
    """Reduce scalar metrics over the ranks of ``group`` (default: the world) with one collective.

    Keys ending in ``/max`` or ``_max`` are reduced with MAX, ``/min`` or ``_min`` with MIN, counts (``/failures``)
    with SUM, all others with the mean. Keys are sorted so that every rank packs the same layout
    into one float64 tensor on ``device`` (CPU by default; use the current CUDA device with NCCL). The
    tensor also carries a checksum of the key names: ranks that disagree on the keys raise
    ``ValueError`` instead of silently mixing metrics (the key *count* must agree, as the collective's
    shapes must). The single collective is an all_gather; each rank then reduces the gathered
    ``[world, keys]`` table, so mean, max and min need no separate collectives.

    The result keeps the caller's key order. Without an initialised torch.distributed (or with one rank) the
    metrics come back as floats, unchanged.
    """
    keys = sorted(metrics)
    values = [float(metrics[k]) for k in keys]

    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group=group) == 1:
        return {k: float(v) for k, v in metrics.items()}
    world = dist.get_world_size(group=group)

    signature = float(zlib.crc32("\n".join(keys).encode("utf-8")))  # exact in float64
    local = torch.tensor(values + [signature], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    table = torch.stack(gathered).cpu()  # [world, len(keys) + 1]

    if not bool((table[:, -1] == signature).all()):
        raise ValueError(
            "reduce_metrics: ranks passed different metric keys; every rank must log the same keys "
            f"(this rank: {keys})"
        )
    out: Dict[str, float] = {}
    for j, key in enumerate(keys):
        column = table[:, j]
        key_op = _key_op(key)
        if key_op == "mean":
            out[key] = float(column.sum().item()) / world
        elif key_op == "sum":
            out[key] = float(column.sum().item())
        elif key_op == "max":
            out[key] = float(column.max().item())
        else:
            out[key] = float(column.min().item())
    return {k: out[k] for k in metrics}  # the caller's order (log lines print in it)
