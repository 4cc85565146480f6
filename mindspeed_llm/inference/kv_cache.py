"""The static engine's KV cache: the slot layout of one batch (`KVCachePlan`, built by `plan_kv_cache`) and the
model that runs prefill and decode forwards over it (`KVCacheModel`: megatron's `GPTInferenceWrapper` with a
`StaticInferenceContext` sized for the plan, optionally recording each slot's MoE routing).

`inference/static_engine.py` plans a batch, drives a `KVCacheModel` with its decode loop and describes the two slot
layouts (batched and stepwise prefill); `inference/cuda_graph.py` subclasses `KVCacheModel` with fixed-shape decode
steps. Both import this module; it imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from megatron.core.inference.communication_utils import is_pipeline_last_stage
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
from megatron.core.utils import get_attr_wrapped_model, get_model_config, unwrap_model

from mindspeed_llm.models import routing


# ---------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class KVCachePlan:
    """The KV-cache slot layout of one batch: row b's prompt occupies slots [offsets[b], offsets[b] + L_b),
    its j-th response token slot starts[b] + j (`inference/static_engine.py`'s module docstring
    describes the two prefill modes)."""

    batched: bool
    offsets: List[int]  # [B] first prompt slot of each row: its left padding (0 when stepwise)
    starts: torch.Tensor  # [B] slot of each row's first response token
    first_step: int  # slots [0, first_step) are prefilled in one forward
    slots: int  # T, the KV cache's sequence length
    max_prompt: int  # L_max
    max_response: int  # R_max
    prompt_lengths: torch.Tensor  # [B]
    budgets: torch.Tensor  # [B] the most tokens each row may generate
    position_ids: torch.Tensor  # [B, T] the true position of each slot (rope ignores them)
    key_is_pad: torch.Tensor  # [B, 1, 1, T] True at the left padding (megatron: True = masked)
    share_index: Optional[torch.Tensor]  # [B] row -> its prefill row; None: every row prefills itself
    unique_rows: Optional[torch.Tensor]  # the rows that run the shared prefill


def plan_kv_cache(prompts: List[List[int]], budgets: List[int], *, batched: bool, share_prefill: bool, device,
                  decode_slots: int = 0) -> KVCachePlan:
    """Lays the batch out in the KV cache: prompts left-padded to the longest one (batched prefill) or
    right-padded (stepwise), and finds the rows that can share a prefill row. `decode_slots`: at least that many
    slots after the prefill (expert-parallel peers decode in lock-step)."""
    lengths = [len(p) for p in prompts]
    L_min, L_max, R_max = min(lengths), max(lengths), max(budgets)
    if batched:
        T = L_max + R_max
        offsets = [L_max - L for L in lengths]
        starts, first_step = [L_max] * len(prompts), L_max
    else:
        T = max(L + R for L, R in zip(lengths, budgets))
        offsets = [0] * len(prompts)
        starts, first_step = lengths, L_min
    T = max(T, first_step + decode_slots)
    share_index = unique_rows = None
    if share_prefill:
        # Batched: the whole prompt (its left padding follows from its length). Stepwise: the first L_min tokens.
        share_index, unique_rows = _prefill_sharing([tuple(p if batched else p[:L_min]) for p in prompts], device)
    offsets_t = torch.tensor(offsets, dtype=torch.long, device=device).unsqueeze(1)
    slots = torch.arange(T, device=device).unsqueeze(0)
    return KVCachePlan(
        batched=batched, offsets=offsets, first_step=first_step, slots=T, max_prompt=L_max, max_response=R_max,
        starts=torch.tensor(starts, dtype=torch.long, device=device),
        prompt_lengths=torch.tensor(lengths, dtype=torch.long, device=device),
        budgets=torch.tensor(budgets, dtype=torch.long, device=device),
        position_ids=(slots - offsets_t).clamp(min=0),
        key_is_pad=(slots < offsets_t).view(len(prompts), 1, 1, T),
        share_index=share_index, unique_rows=unique_rows,
    )


def _prefill_sharing(windows: List[tuple], device) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Rows whose prefill window is identical (GRPO repeats each prompt n times) share one prefill row:
    returns (row -> its prefill row, the rows that prefill), or (None, None) where no window repeats."""
    prefill_row_of, share, unique_rows = {}, [], []
    for row, window in enumerate(windows):
        if window not in prefill_row_of:
            prefill_row_of[window] = len(unique_rows)
            unique_rows.append(row)
        share.append(prefill_row_of[window])
    if len(unique_rows) == len(windows):
        return None, None
    return (torch.tensor(share, dtype=torch.long, device=device),
            torch.tensor(unique_rows, dtype=torch.long, device=device))


# ---------------------------------------------------------------------------------------------- forward passes
class KVCacheModel:
    """`model` behind Megatron's `GPTInferenceWrapper`, with a static KV cache sized for the plan's batch."""

    def __init__(self, model, plan: KVCachePlan, record_routing: bool = False):
        config = get_model_config(model)
        wrapper_config = InferenceWrapperConfig(
            hidden_size=config.hidden_size,
            params_dtype=config.params_dtype,
            inference_batch_times_seqlen_threshold=-1,  # whole batch per pipeline step, no micro-batching
            padded_vocab_size=int(getattr(unwrap_model(model), "vocab_size", 0) or 0),
            inference_max_requests=len(plan.offsets),
            inference_max_seq_length=plan.slots,
            fp32_residual_connection=config.fp32_residual_connection,
        )
        self.model, self.plan = model, plan
        self.context = StaticInferenceContext(max_batch_size=len(plan.offsets), max_sequence_length=plan.slots)
        self.wrapper = GPTInferenceWrapper(model, wrapper_config, self.context)
        self.last_stage = is_pipeline_last_stage(self.wrapper.pp_group)
        self.was_training = model.training
        self.stepwise_mask = None  # [1, 1, T, T] megatron's causal mask, for the stepwise prefill
        # [B, layers, T, topk] each slot's experts per MoE layer of this rank (-1: not run), when recording
        self.capture = self.routing = None
        if record_routing and routing.moe_routers(model):
            self.capture = routing.RoutingCapture(model)
            self.routing = torch.full((len(plan.offsets), len(self.capture.routers), plan.slots,
                                       routing.router_topk(model)), -1, dtype=routing.ROUTING_DTYPE,
                                      device=plan.starts.device)

    def prepare(self, tokens: torch.Tensor) -> None:
        """eval(), an empty context, pipeline detection; the causal mask of the stepwise prefill."""
        self.wrapper.prep_model_for_inference()
        if not self.plan.batched:
            self.stepwise_mask = self.wrapper.prep_inference_input(tokens)["attention_mask"]

    def release(self) -> None:
        """Frees the KV cache (its size kept in `cache_bytes`), resets the context and the pipeline input, restores
        the model's train/eval mode."""
        self.cache_bytes = sum(buf.nbytes for buffers in self.context.key_value_memory_dict.values()
                               for buf in buffers if isinstance(buf, torch.Tensor))
        self.context.key_value_memory_dict.clear()
        self.context.reset()
        get_attr_wrapped_model(self.model, "set_input_tensor")(None)
        self.model.train(self.was_training)
        if self.capture is not None:
            self.capture.close()

    def forward(self, tokens: torch.Tensor, start: int, end: int,
                rows: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Runs slots [start, end) (KV cache offset = start) for every row, or only for `rows` (which then fill
        cache rows 0 .. len(rows)-1); logits [B or len(rows), V] of slot end-1 on the last stage, else None."""
        window_tokens, window_positions = tokens[:, start:end], self.plan.position_ids[:, start:end]
        if rows is not None:
            window_tokens, window_positions = window_tokens[rows], window_positions[rows]
        window = {"tokens": window_tokens, "position_ids": window_positions,
                  "attention_mask": self._mask(start, end, rows)}
        if self.wrapper.model_is_pipeline_parallel:
            out = self.wrapper.forward_pass_with_pipeline_parallel_small_input_batch(window)
        else:
            out = self.wrapper.forward_pass_without_pipeline_parallel(window)
        if self.capture is not None:
            self._record(start, end, rows)
        return out[:, -1, :] if out is not None else None

    def _record(self, start: int, end: int, rows: Optional[torch.Tensor]) -> None:
        """Stores the routing of the forward over slots [start, end) (router order: slot-major, then row)."""
        count = self.routing.size(0) if rows is None else rows.numel()
        for layer, ids in enumerate(self.capture.last()):
            per_slot = ids.view(end - start, count, -1).transpose(0, 1).to(self.routing.dtype)
            if rows is None:
                self.routing[:, layer, start:end] = per_slot
            else:
                self.routing[rows, layer, start:end] = per_slot
        self.capture.clear()

    def _mask(self, start: int, end: int, rows: Optional[torch.Tensor]) -> torch.Tensor:
        """Megatron's attention mask (True = masked) of queries [start, end) over keys [0, end)."""
        if not self.plan.batched:
            return self.stepwise_mask[..., start:end, :end]  # [1, 1, ., .]: the same for every row
        mask = (self.plan.key_is_pad if rows is None else self.plan.key_is_pad[rows])[..., :end]
        if end - start > 1:  # prefill: causal within the window as well
            causal = torch.ones((end - start, end), dtype=torch.bool, device=mask.device).triu(1 + start)
            mask = mask | causal.view(1, 1, end - start, end)
        return mask

    def prefill(self, tokens: torch.Tensor) -> Optional[torch.Tensor]:
        """Slots [0, first_step) of every row; with repeated prompts, one forward over the unique ones, whose
        KV-cache rows and logits are then copied to the rows that repeat them (a copy of what their own
        forward would compute: the rows of a batch never mix)."""
        plan = self.plan
        if plan.share_index is None:
            return self.forward(tokens, 0, plan.first_step)
        logits = self.forward(tokens, 0, plan.first_step, plan.unique_rows)
        batch = plan.share_index.numel()
        if self.routing is not None:
            prefill_row = plan.unique_rows[plan.share_index]
            self.routing[:, :, :plan.first_step] = self.routing[prefill_row, :, :plan.first_step]
        for buffers in self.context.key_value_memory_dict.values():  # this stage's layers: [T, B, groups, dim]
            for buf in buffers:
                if buf is not None:
                    buf[:plan.first_step, :batch] = buf[:plan.first_step, plan.share_index]
        return logits[plan.share_index] if logits is not None else None

    def decode_step(self, tokens: torch.Tensor, pos: int) -> Optional[torch.Tensor]:
        """Runs slot `pos` of every row; logits of that slot on the last stage."""
        if pos >= self.plan.max_prompt:
            self.context.enable_decode_mode()  # the token fed is a generated one in every row
        return self.forward(tokens, pos, pos + 1)


__all__ = ["KVCachePlan", "plan_kv_cache", "KVCacheModel"]
