"""Micro-batches through megatron's pipeline schedule, for every model role.

`run_schedule` runs megatron's forward(-backward) schedule over a step's micro-batches (`_model_forward`: a
micro-batch's layout, packed groups, sequence / context parallelism, MoE padding and routing replay);
`forward_only` is every pass that only reads (old / reference log-probs, values, reward scores);
`schedule_loss_scale` is what a loss share is multiplied by so that the gradient is that of the step's loss. The RL
math lives in the loss closures the stages pass in. The trained model that steps its optimizer on these is
`trainable.TrainableModel`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from mindspeed_llm import device
from mindspeed_llm.models.attention import layout_params, model_attention
from mindspeed_llm.models.context_parallel import ContextParallelLayout, context_parallel_size, forward_width
from mindspeed_llm.models.forward_layout import forward_layout
from mindspeed_llm.models.routing import micro_batch_routing
from mindspeed_llm.rl.update import moe

MicroBatch = Dict[str, torch.Tensor]
# loss_fn(output, micro_batch) -> (this micro-batch's share of the step's loss, {metric name: its share});
# the shares of all micro-batches on all DP ranks add up to the step's loss and metrics (see train_step).
LossFn = Callable[[torch.Tensor, MicroBatch], tuple]
# output_fn(output, micro_batch) -> tensor with micro-batch rows first
OutputFn = Callable[[torch.Tensor, MicroBatch], torch.Tensor]



def _model_forward(model, micro_batch: MicroBatch):
    """Outputs `[rows, T - logits_from, ...]`: RoPE at the micro-batch's position ids, causal attention or its
    packed prompt groups, and nothing computed for the positions before `logits_from` (`rl/update/batch_plan.py`).

    Packed groups reach the fused core attention as megatron's `packed_seq_params` (`models/attention.py`);
    megatron's local attention gets them as the dense mask, built here for this micro-batch only. Under sequence
    parallelism the rows are padded to a multiple of TP (megatron splits the sequence over the TP ranks); under
    context parallelism to a multiple of 2 CP (x TP), and this rank runs its two chunks of them
    (`models/context_parallel.py`), with its outputs from `logits_from` on: the layout goes into the micro-batch
    (`micro_batch["cp_layout"]`) for the reads (`batch_plan.read_outputs`). The padding is never read."""
    tokens, position_ids = micro_batch["tokens"], micro_batch["position_ids"]
    groups = micro_batch.get("packed_groups")
    logits_from = int(micro_batch.get("logits_from", 0))
    cp = context_parallel_size()
    width = forward_width(model, tokens.shape[1])
    if width != tokens.shape[1]:
        extra_columns = width - tokens.shape[1]
        tokens = torch.nn.functional.pad(tokens, (0, extra_columns))
        tail = torch.arange(tokens.shape[1] - extra_columns, width, device=tokens.device)
        position_ids = torch.cat([position_ids, tail.expand(position_ids.shape[0], -1)], dim=1)
        if groups is not None:
            groups = dataclasses.replace(groups, seq_length=width)
    pad = moe.padding_mask(micro_batch, width) if moe.is_moe(model) else None
    extra = {} if pad is None else {"padding_mask": pad}  # MoE routers leave padding out of their loss and counts
    mask, spans = None, None
    layout = ContextParallelLayout.current(width) if cp > 1 else None
    if layout is not None:
        extra["packed_seq_params"] = layout_params(groups, layout, width)
        tokens, position_ids = layout.split(tokens), layout.split(position_ids)
        spans = layout.local_output_spans(logits_from)
        micro_batch["cp_layout"] = layout
    elif groups is not None:
        if model_attention(model) == "sdpa":
            extra["packed_seq_params"] = groups.seq_params()
        else:
            mask = groups.dense_mask(tokens.device)
    with forward_layout(model, position_ids, logits_from, output_spans=spans), \
            micro_batch_routing(model, micro_batch, width):  # --moe-routing-replay, moe/routing_mismatch
        return model(tokens, position_ids, mask, **extra)


def run_schedule(chunks, micro_batches: Sequence[MicroBatch], step_fn, forward_only: bool):
    """Run megatron's schedule; returns what the last stage's loss closures reported, one per micro-batch."""
    first = micro_batches[0]
    tokens = first["tokens"]

    def loss_closure(output, micro_batch):
        loss, metrics = step_fn(output, micro_batch)
        # The schedule divides the loss in place; metrics must not share its storage.
        return loss, {k: torch.as_tensor(v).detach().clone() for k, v in metrics.items()}

    def forward_step(data_iterator, model):
        micro_batch = next(data_iterator)
        output = _model_forward(model, micro_batch)
        return output, lambda out: loss_closure(out, micro_batch)

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=chunks,
        num_microbatches=len(micro_batches),
        seq_length=tokens.shape[1],
        micro_batch_size=tokens.shape[0],
        forward_only=forward_only,
    )


def schedule_loss_scale(num_microbatches: int, data_parallel_size: int) -> float:
    """What a loss share is multiplied by before Megatron's schedule sees it.

    Megatron divides each micro-batch's loss by the number of micro-batches (`forward_step`) and DDP averages
    gradients over the DP ranks; a share of the step's loss is already divided by the step's global token or
    sequence count, so both divisions are undone here and the gradient is that of the sum of the shares. Under
    context parallelism DDP averages over DP x CP and megatron's schedule multiplies each loss by the CP size
    itself (Megatron-LM's convention: a CP rank's loss covers its own tokens); every CP rank here computes the
    whole share, each differentiating its own positions only (`models/context_parallel.py`), so the CP sum of their
    gradients is the share's, and `data_parallel_size` stays megatron's DP size without CP.
    """
    return float(num_microbatches * data_parallel_size)


def _broadcast_from_last_stage(tensor: Optional[torch.Tensor], shape, dtype) -> torch.Tensor:
    """Give every pipeline stage the tensor that only the last stage computed."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return tensor
    if tensor is None:
        tensor = torch.empty(shape, dtype=dtype, device=device.current_device())
    dist.broadcast(
        tensor,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return tensor


def _padded(out: torch.Tensor, shape_tail) -> torch.Tensor:
    """`out` `[rows, w, ...]` zero-padded along dim 1 to `shape_tail[0]` (as is when it has no such dim)."""
    if not shape_tail or out.dim() < 2 or out.size(1) == shape_tail[0]:
        return out
    return torch.nn.functional.pad(out, (0, 0) * (out.dim() - 2) + (0, shape_tail[0] - out.size(1)))


@torch.no_grad()
def forward_only(model, micro_batches: Sequence[MicroBatch], output_fn: OutputFn, out_shape_tail=()) -> torch.Tensor:
    """Forward every micro-batch and concatenate `output_fn`'s results along rows, on every PP stage.

    `out_shape_tail` is the per-row shape of output_fn's result (e.g. (R,) for per-token log-probs),
    needed by the stages that receive it.
    """
    chunks = model if isinstance(model, list) else [model]
    was_training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        results = run_schedule(
            chunks, micro_batches, lambda out, mb: (out.new_zeros(()), {"out": output_fn(out, mb).float()}), True
        )
    finally:
        for c, mode in zip(chunks, was_training):
            c.train(mode)
    rows = sum(mb["responses"].shape[0] for mb in micro_batches)  # samples (packed groups hold several)
    local = None
    if parallel_state.is_pipeline_last_stage():
        # a micro-batch's per-token outputs are as wide as its longest response (`batch_plan`): pad to the batch's;
        # and token-budget micro-batches hold the samples in another order (`order`): put them back
        local = torch.cat([_padded(r["out"], out_shape_tail) for r in results])
        if all("order" in mb for mb in micro_batches):
            order = torch.cat([mb["order"] for mb in micro_batches]).to(local.device)
            local = torch.empty_like(local).index_copy_(0, order, local)
    return _broadcast_from_last_stage(local, (rows, *out_shape_tail), torch.float32)
