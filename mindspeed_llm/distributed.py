"""Process-group and Megatron parallel-state setup: the one SPMD group all models of a stage live in."""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as dist

from mindspeed_llm import device


def initialize(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    seed: int = 1234,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    timeout_minutes: int = 30,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    context_parallel_size: int = 1,
    trainer_world_size: Optional[int] = None,
) -> None:
    """Init torch.distributed (env:// as torchrun sets it) and megatron's TP/CP/PP/DP groups, then seed.

    `trainer_world_size` T (asynchronous RL's placement, `rl/async_rl/placement.py`): megatron's groups cover the
    world's first T ranks only (`patches/trainer_world.py`); the others are generator ranks, outside megatron's
    parallel state, which seed their tensor-parallel RNG from their own groups once those exist
    (`seed_all(seed, groups)`); here they seed the default generators alone. Default: the whole world.

    Context parallelism (`context_parallel_size` N) is megatron's: the CP groups sit between TP and DP in its rank
    order, its data-parallel groups leave them out (DP = world / (TP x CP x PP)) and its DDP reduces gradients
    over DP x CP. The RL data follows the DP groups (the CP ranks of a DP rank hold the same samples in every
    forward, `models/context_parallel.py`), except the rollout, which the DP x CP ranks share
    (`rollout_parallel_info`).

    Mixture-of-experts layers get megatron's second decomposition of the same ranks ("MoE parallel
    folding"): expert TP (default: TP) x expert parallel x expert data parallel x PP. MindSpeed's
    `--moe-tp-extend-ep` is expert TP 1 with the experts split over EP x TP ranks (the caller passes those).

    Every rank gets the same `seed` for model initialisation (megatron offsets the tensor-parallel RNG by TP
    rank itself), so a model built on any layout starts from the same weights.
    """
    acc = device.setup()
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    process_count = world_size
    if trainer_world_size is not None:
        if not 1 <= trainer_world_size <= world_size:
            raise ValueError(f"trainer_world_size {trainer_world_size} must be in 1 .. the world size {world_size}")
        world_size = trainer_world_size  # megatron's world from here on
    if world_size % (tp * pp * cp):
        raise ValueError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--context-parallel-size {cp} x --pipeline-model-parallel-size {pp}; launch a multiple of "
            f"{tp * pp * cp} processes"
        )
    ep = expert_model_parallel_size
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    if world_size % (etp * ep * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by expert tensor parallel {etp} x expert parallel {ep} x "
            f"--pipeline-model-parallel-size {pp}; launch a multiple of {etp * ep * pp} processes or lower "
            f"--expert-model-parallel-size"
        )
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(
            acc.backend, rank=rank, world_size=process_count, timeout=timedelta(minutes=timeout_minutes)
        )
    from megatron.core import parallel_state

    from mindspeed_llm.patches.trainer_world import narrowed_world

    if not parallel_state.model_parallel_is_initialized():
        with narrowed_world(world_size) if trainer_world_size is not None else contextlib.nullcontext():
            parallel_state.initialize_model_parallel(
                tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    if dist.get_rank() < world_size:
        seed_all(seed)
    else:  # a generator rank: its tensor-parallel RNG follows its own groups (seed_all(seed, groups))
        device.manual_seed(seed)


def seed_all(seed: int, groups=None) -> None:
    """Seed every generator, including megatron's tensor-parallel RNG tracker (offset by the TP rank: megatron's
    parallel state's, or that of explicit `groups`, the ProcessGroupCollection a generator rank's model is built on;
    such a model is dense, so its expert ranks are 0)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    device.manual_seed(seed)
    if groups is None:
        model_parallel_cuda_manual_seed(seed)
    else:
        model_parallel_cuda_manual_seed(seed, tp_rank=groups.tp.rank(), ep_rank=0, etp_rank=0)


def destroy() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def data_parallel_info():
    """(dp_rank, dp_size) of this rank."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def rollout_parallel_info():
    """(rank, size) of this rank among the ranks that share a rollout: DP x CP (megatron's `dp_cp` group, in which
    DP rank d's CP rank c is d x CP + c), each generating its own prompts; (dp_rank, dp_size) without CP."""
    from megatron.core import parallel_state

    return (parallel_state.get_data_parallel_rank(with_context_parallel=True),
            parallel_state.get_data_parallel_world_size(with_context_parallel=True))


def gather_over_context_parallel(obj) -> list:
    """Every rank of this rank's context-parallel group's picklable `obj`, in CP rank order (`[obj]` without CP)."""
    from megatron.core import parallel_state

    size = parallel_state.get_context_parallel_world_size()
    if size == 1:
        return [obj]
    out = [None] * size
    dist.all_gather_object(out, obj, group=parallel_state.get_context_parallel_group())
    return out


def sum_over_data_parallel(tensor):
    """`tensor` summed over this rank's data-parallel group (a new tensor; `tensor` itself without DP).

    The one reduction the RL math needs to see a whole batch that DP ranks hold in shards: token and
    sequence counts, whitening statistics (`rl.core_algos`' `sum_across`), metric shares.
    """
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_world_size() == 1:
        return tensor
    out = tensor.clone()
    dist.all_reduce(out, group=parallel_state.get_data_parallel_group())
    return out


def max_over_data_parallel(value: int) -> int:
    """The largest `value` of this rank's data-parallel group (`value` itself without DP): e.g. a micro-batch count
    that every DP rank must share (expert-parallel peers exchange tokens in every forward)."""
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_world_size() == 1:
        return int(value)
    out = torch.tensor([int(value)], dtype=torch.long, device=device.current_device())
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
    return int(out.item())


def first_rank_of_data_parallel_rank() -> bool:
    """True on one rank of each data-parallel rank (TP, PP and CP rank 0): the one that writes what the DP rank's
    ranks all hold alike (a dumped rollout). True without a process group."""
    if not dist.is_initialized():
        return True
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_pipeline_model_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank() == 0)


def gather_over_data_parallel(obj) -> list:
    """Every rank of this rank's data-parallel group's picklable `obj`, in DP rank order (`[obj]` without DP)."""
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_world_size() == 1:
        return [obj]
    out = [None] * parallel_state.get_data_parallel_world_size()
    dist.all_gather_object(out, obj, group=parallel_state.get_data_parallel_group())
    return out


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on any rank of the job."""
    if not dist.is_initialized():
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int32, device=device.current_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def gather_messages(message: Optional[str]) -> List[str]:
    """Every rank's non-empty `message`, prefixed with its rank: for an error that every rank raises alike."""
    if not dist.is_initialized():
        return [message] if message else []
    return [f"rank {r}: {m}" for r, m in enumerate(gather_over_world(message)) if m]


def gather_over_world(obj) -> list:
    """Every rank's picklable `obj`, in rank order (`[obj]` without a process group)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def world_share():
    """(this rank, the world size, gather): for work the ranks split and then all hold (`rl.tools.prompts.Ranks`);
    gather(obj) is every rank's picklable obj in rank order. One process's without a process group."""
    if not dist.is_initialized():
        return 0, 1, gather_over_world
    return dist.get_rank(), dist.get_world_size(), gather_over_world


def broadcast_object(obj, src_rank: int = 0, group=None):
    """Broadcast a picklable object from global `src_rank` (identity when not distributed)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src_rank, group=group)
    return box[0]


def is_rank_0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


__all__ = ["initialize", "destroy", "seed_all", "data_parallel_info", "rollout_parallel_info",
           "gather_over_context_parallel", "sum_over_data_parallel", "any_rank",
           "gather_messages", "gather_over_world", "world_share", "broadcast_object", "is_rank_0", "barrier"]
