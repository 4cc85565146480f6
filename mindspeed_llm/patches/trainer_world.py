"""Megatron's parallel state over the trainer ranks of a world split by role (asynchronous RL, all devices).

megatron-core 0.16.1's `initialize_model_parallel` lays its TP / CP / DP / PP / EP groups over
`torch.distributed.get_world_size()` ranks, every rank of the world. Under `--rollout-world-size R` (issue 47,
`rl/async_rl/placement.py`) the world's last R ranks generate on groups of their own, so megatron's groups must
cover the first T = W - R ranks only: the trainers' groups, checkpoints and resume are then a T-process run's. The
patch runs `initialize_model_parallel` with the world size read as T while `narrowed_world(T)` is open
(`distributed.initialize(trainer_world_size=T)` opens it); every rank still calls it, since torch's `new_group` is
collective over the whole world: the generator ranks take part in each group's creation and belong to none
(`model_parallel_is_initialized()` is False there). Outside `narrowed_world` it is megatron's function as it is.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

from mindspeed_llm.patches import applied, register

TARGET = "megatron.core.parallel_state.initialize_model_parallel"
_narrowed: Optional[int] = None  # T while `narrowed_world(T)` is open


@contextlib.contextmanager
def narrowed_world(trainer_world_size: int):
    """Megatron's groups over the world's first `trainer_world_size` ranks for `initialize_model_parallel` calls in
    the block; needs the patch applied (`device.setup()`)."""
    global _narrowed
    if TARGET not in applied():
        raise RuntimeError(f"narrowed_world: the patch of {TARGET} is not applied (device.setup() applies it)")
    _narrowed = int(trainer_world_size)
    try:
        yield
    finally:
        _narrowed = None


@register(TARGET, "megatron lays its groups over the whole world; with generator ranks (--rollout-world-size) they "
                  "must cover the trainer ranks only, so the world size is read as the trainers' count",
          devices=("cpu", "cuda", "npu"))
def _over_trainers(original):
    import torch.distributed as dist

    @functools.wraps(original)
    def initialize_model_parallel(*args, **kwargs):
        size = _narrowed
        if size is None:
            return original(*args, **kwargs)
        world_size = dist.get_world_size
        dist.get_world_size = lambda group=None: size if group is None else world_size(group)
        try:
            return original(*args, **kwargs)
        finally:
            dist.get_world_size = world_size

    return initialize_model_parallel
