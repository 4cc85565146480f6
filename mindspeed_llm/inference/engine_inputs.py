"""What both generation engines (`static_engine.py`, `continuous.py`) take from the batch and the parallel state:
the rank that picks a model-parallel group's tokens (`source_rank`), the expert-parallel peers that must run as many
forwards (`expert_peers`, `group_max`), each row's uniforms (`response_uniforms`) and prompts laid out in rows
(`place_prompts`).

The parallel state is megatron's `parallel_state`, or, for a model built on explicit groups (a generator rank of
asynchronous RL, `models.explicit_groups`: a dense model at PP 1 outside megatron's groups), that model's
ProcessGroupCollection; the continuous engine reads those, the static one refuses such a model
(`generation._choose_engine`)."""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_model_config

from mindspeed_llm import device as _device
from mindspeed_llm.inference.sampling import SamplingConfig, sample_uniforms
from mindspeed_llm.models import explicit_groups


def model_parallel_source(group, groups=None) -> Optional[int]:
    """Global rank that samples for this model-parallel group: the last PP stage's TP rank 0 (of megatron's
    parallel state, or of explicit `groups`)."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    if groups is not None:
        is_source = groups.pp.rank() == groups.pp.size() - 1 and groups.tp.rank() == 0
    else:
        is_source = (
            parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0
        )
    mine = torch.tensor([dist.get_rank() if is_source else -1], dtype=torch.long,
                        device=_device.current_device())
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    return int(mine.item())


def default_dp_rank(groups=None) -> int:
    """Megatron's data-parallel rank (that of explicit `groups` if given), 0 without Megatron's parallel state."""
    if groups is not None:
        return groups.dp.rank()
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_rank()
    return 0


def source_rank(model=None):
    """(the model-parallel group or None, the global rank that picks the tokens for it or None): megatron's, or
    those of `model`'s explicit groups (its TP group: such a model has PP 1)."""
    groups = explicit_groups(model) if model is not None else None
    if groups is not None:
        return groups.mp, model_parallel_source(groups.mp, groups)
    group = parallel_state.get_model_parallel_group() if parallel_state.model_parallel_is_initialized() else None
    return group, model_parallel_source(group)


def expert_peers(model):
    """The expert-parallel group of a mixture of experts at EP > 1, else None. Its ranks hold other rollouts (they are
    data-parallel replicas) but exchange tokens in every MoE layer of every forward, so they must run the same
    number of forwards: each decodes until all of them have stopped (a rank that is done runs its finished rows)."""
    if getattr(get_model_config(model), "num_moe_experts", None) is None:
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_expert_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_expert_model_parallel_group()


def group_max(value: int, group) -> int:
    out = torch.tensor([value], dtype=torch.long, device=_device.current_device())
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return int(out.item())


def response_uniforms(sampling: SamplingConfig, iterations: Sequence[int], sample_ids: Optional[Sequence[int]],
                       batch_size: int, max_response: int, device, groups=None) -> Optional[torch.Tensor]:
    """[B, R_max] uniforms (row b's j-th response token is drawn with [b, j], from the stream of sample
    `sample_ids[b]` in RL iteration `iterations[b]`; default ids from the data-parallel rank of megatron or of
    explicit `groups`); None when greedy."""
    if not sampling.do_sample:
        return None
    if sample_ids is None:
        first = default_dp_rank(groups) * batch_size
        sample_ids = range(first, first + batch_size)
    if len(sample_ids) != batch_size:
        raise ValueError(f"generate: {len(sample_ids)} sample_ids for {batch_size} prompts")
    sample_ids = [int(i) for i in sample_ids]
    table = np.empty((batch_size, max(max_response, 1)), dtype=np.float64)
    for it in sorted(set(iterations)):  # one call per iteration (a continuation keeps the stream it started in)
        rows = [b for b in range(batch_size) if iterations[b] == it]
        table[rows] = sample_uniforms(sampling.seed, it, [sample_ids[b] for b in rows], table.shape[1])
    return torch.from_numpy(table).to(device)


def place_prompts(prompts: List[List[int]], offsets: List[int], width: int, pad: int, device) -> torch.Tensor:
    """[B, width] pad tokens with row b's prompt at columns [offsets[b], offsets[b] + L_b)."""
    out = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    for b, (p, o) in enumerate(zip(prompts, offsets)):
        out[b, o: o + len(p)] = torch.tensor(p, dtype=torch.long, device=device)
    return out
