"""Context parallelism (`--context-parallel-size N`): a forward over whole sequences split over the N ranks of
megatron's context-parallel group.

Layout (megatron's load-balanced order). A micro-batch's rows, padded to a width S that is a multiple of 2N (and of
2N x TP under sequence parallelism), are cut into 2N chunks of c = S / 2N positions; CP rank r holds chunks r and
2N-1-r, in that order, as its local sequence of 2c positions. With causal attention the early chunks attend to few
keys and the late ones to many, so every rank gets one of each: the same work on every rank. Everything of a
position (its token, its position id for the rotary embedding, its activations, its outputs) lives on the rank
that holds it; `ContextParallelLayout` is the arithmetic, in Python ints from the micro-batch's shape.

Attention sees the whole sequence: each layer all-gathers the keys and values over the CP group
(`all_gather_sequence`; its backward reduce-scatters their gradients back to the ranks that hold them), and the
local queries of each chunk attend to the keys up to their own position (`models/attention.py`, causal rows and
packed prompt groups alike). Memory: each layer keeps S x (key + value width) per rank instead of an S x S score
tensor, and the local activations are 1/N of the sequence's.

Outputs: the output layer runs on the local positions from `logits_from` on (`local_output_spans`); a read at
global position p (`batch_plan`'s response and last-token indices) is `local_index(p)`: its place in this rank's
outputs and whether this rank holds it. The per-token results of the RL reads (log-probs, entropies, values,
scores) are put at their places in a zero tensor and summed over the CP group (`sum_over_context_parallel`,
whose backward is the identity): every CP rank then holds every sample's full result and computes the same loss,
while the gradient of each position flows on the rank that holds it only; megatron's DDP sums the gradients over
DP x CP (its `dp_cp` group), which gives the gradient of the one loss.

The models are built with `context_parallel_size=1` in their TransformerConfig: CP is a property of a forward
(a training forward or a log-prob / value / reward pass sets it through `packed_seq_params`, see
`models/attention.PackedGroupsParams`), not of the model, so generation (where each CP rank decodes its own
samples, as a data-parallel replica) runs the same model without it. Megatron's rotary embedding would slice its
table for the CP rank by itself; `builder.build_model` turns that off (RoPE is placed by position ids,
`models/forward_layout.py`, which are split with the tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def context_parallel_size() -> int:
    """Megatron's context-parallel world size (1 before its parallel state exists)."""
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_context_parallel_world_size()


@dataclass(frozen=True)
class ContextParallelLayout:
    """Where the positions of a micro-batch `seq_length` wide live: CP rank `rank` of `size` holds chunks `rank`
    and `2 size - 1 - rank` of `seq_length / (2 size)` positions (module docstring)."""

    size: int
    rank: int
    seq_length: int
    group: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.size < 2 or not 0 <= self.rank < self.size:
            raise ValueError(f"ContextParallelLayout: rank {self.rank} of {self.size}")
        if self.seq_length % (2 * self.size):
            raise ValueError(f"ContextParallelLayout: {self.seq_length} positions do not split into "
                             f"{2 * self.size} chunks")

    @classmethod
    def current(cls, seq_length: int) -> "ContextParallelLayout":
        """The layout of this rank in megatron's context-parallel group."""
        return cls(parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank(),
                   seq_length, parallel_state.get_context_parallel_group())

    @property
    def chunk(self) -> int:
        return self.seq_length // (2 * self.size)

    def spans(self) -> Tuple[Tuple[int, int], Tuple[int, int]]:
        """The global positions `[start, end)` of this rank's two chunks, in local order."""
        c = self.chunk
        first, second = self.rank, 2 * self.size - 1 - self.rank
        return (first * c, (first + 1) * c), (second * c, (second + 1) * c)

    def split(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's positions of `tensor` along `dim` (`seq_length` long there), in local order."""
        (a, _), (b, _) = self.spans()
        return torch.cat([tensor.narrow(dim, a, self.chunk), tensor.narrow(dim, b, self.chunk)], dim=dim)

    def natural_order(self, device) -> torch.Tensor:
        """`[seq_length]`: for each global position, its index in the CP group's gathered local sequences (rank 0's
        two chunks, then rank 1's, ...)."""
        c, n = self.chunk, self.size
        starts = [g * 2 * c if g < n else (2 * n - 1 - g) * 2 * c + c for g in range(2 * n)]
        return torch.cat([torch.arange(s, s + c, device=device) for s in starts])

    def _dropped(self, logits_from: int) -> Tuple[int, int]:
        """How many leading positions of each local chunk lie before `logits_from`."""
        return tuple(min(max(logits_from - start, 0), self.chunk) for start, _ in self.spans())

    def local_output_spans(self, logits_from: int) -> Tuple[Tuple[int, int], ...]:
        """The local slices `[start, stop)` whose positions are at or after `logits_from` (what the output layer
        computes here), in local order; empty slices left out."""
        c = self.chunk
        drop_a, drop_b = self._dropped(logits_from)
        spans = ((drop_a, c), (c + drop_b, 2 * c))
        return tuple((a, b) for a, b in spans if a < b)

    def local_index(self, positions: torch.Tensor, logits_from: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """For global `positions` (>= `logits_from` where read): (their index in this rank's outputs, clamped to 0
        where not held; a bool tensor, True where this rank holds them)."""
        c = self.chunk
        (a0, a1), (b0, b1) = self.spans()
        drop_a, drop_b = self._dropped(logits_from)
        in_a = (positions >= a0) & (positions < a1)
        in_b = (positions >= b0) & (positions < b1)
        index = torch.where(in_a, positions - a0 - drop_a, (c - drop_a) + positions - b0 - drop_b)
        held = (in_a | in_b) & (positions >= logits_from)
        return torch.where(held, index, torch.zeros_like(index)), held


def padded_width(width: int, multiple: int) -> int:
    return -(-width // multiple) * multiple


def forward_width(model, width: int) -> int:
    """The width a training or pass forward pads rows of `width` positions to (`rl/update/engine.py`): a multiple of TP
    under sequence parallelism (megatron splits the sequence over the TP ranks), of 2 CP under context parallelism
    (its chunks), of their product with both."""
    from mindspeed_llm.models.sequence_parallel import is_sequence_parallel

    cp = context_parallel_size()
    multiple = 2 * cp if cp > 1 else 1
    if is_sequence_parallel(model):
        multiple *= parallel_state.get_tensor_model_parallel_world_size()
    return padded_width(width, multiple)


class _AllGatherSequence(torch.autograd.Function):
    """`[s, ...]` per rank -> `[size * s, ...]` (rank order); backward: the gradient summed over the group and each
    rank's part kept (reduce-scatter)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        size = dist.get_world_size(group)
        tensor = tensor.contiguous()
        out = tensor.new_empty((size * tensor.size(0), *tensor.shape[1:]))
        dist.all_gather_into_tensor(out, tensor, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        out = grad.new_empty((grad.size(0) // size, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: every rank holds the sum of the parts and computes the same loss
    from it; each part's gradient stays on the rank that computed it."""

    @staticmethod
    def forward(ctx, tensor, group):
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_gather_sequence(tensor: torch.Tensor, layout: ContextParallelLayout) -> torch.Tensor:
    """The whole sequence `[seq_length, ...]` in natural order from every rank's local `[2c, ...]` part
    (differentiable: the backward returns each rank its positions' gradient, summed over the ranks)."""
    gathered = _AllGatherSequence.apply(tensor, layout.group)
    return gathered.index_select(0, layout.natural_order(tensor.device))


def sum_over_context_parallel(tensor: torch.Tensor, group: Optional[object] = None) -> torch.Tensor:
    """`tensor` summed over the CP group (the identity without CP); the backward is the identity (module doc)."""
    if context_parallel_size() == 1:
        return tensor
    return _SumOverGroup.apply(tensor, group if group is not None else parallel_state.get_context_parallel_group())
