"""The static generation engine (`generate(..., engine="static")`, `inference/generation.py`): megatron's
`GPTInferenceWrapper` + `StaticInferenceContext`, the whole batch in lock-step; the reference, the stepwise prefill
and the CUDA-graph decode step (`cuda_graph.py`); its KV cache and slot plan are `kv_cache.py`'s.

Megatron's `StaticInferenceEngine` is not used: for RL it samples untempered log-probs, allows only one of
top-k/top-p, seeds every rank alike and leaves the model in eval() with its KV buffers alive. Instead this
module drives Megatron's `GPTInferenceWrapper` + `StaticInferenceContext` (the same KV cache, rotary
handling and pipeline send/recv the engine uses) with its own decode loop.

Megatron's static KV cache stores the batch in lock-step: slot s of every row is written at the same step,
and the rotary embedding of a slot is that of position s for every row. Two ways to fill it:

* `prefill="batched"` (default where supported): prompts are LEFT-padded to the longest prompt L_max and
  prefilled in one forward, with a per-row attention mask that hides the pad slots (causal + key-padding
  in the prefill, key-padding in each decode step). Every row then generates from slot L_max on, one
  forward per new token. A row's tokens sit at slots shifted by its pad count; rotary attention scores
  depend only on the distance between query and key, so the shift changes nothing (it is exactly what
  `transformers` does with left padding). Needs attention that honours an explicit mask: both core attentions
  `mindspeed_llm.models` builds do (the fused `SDPAttention`, the default, and megatron's local unfused-softmax
  attention without a sliding window).
* `prefill="stepwise"` (Megatron's controller's scheme; the fallback for other attention backends):
  prompts are right-padded, one forward prefills the first L_min = min_b L_b positions, then one position
  per step: rows still inside their prompt take their next prompt token ("forced"), the others a new
  token. No mask is ever needed, but mixed prompt lengths cost L_max - L_min extra steps.

Both stop when every row has hit a stop token or its length budget. Rows whose prefill window is identical
(GRPO's n samples of a prompt) are prefilled once: one forward over the distinct windows, then their KV-cache
rows and last logits are copied to the repeats (rows never interact in a forward, so a copy is what their own
forward would compute; all layouts, TP and PP included: every stage sees the same, smaller prefill batch).
Tokens are generated under `torch.no_grad()` (not `inference_mode`: Megatron lru-caches rotary tables, and an
inference tensor cached here would break a later training forward of the same length).

Speed: megatron computes only the last position's logits per forward (`StaticInferenceContext` sets
`materialize_only_last_token_logits`). On every device, `mindspeed_llm/patches/inference.py` makes each decode step
cost O(new tokens) in rotary work instead of O(cached tokens), reads grouped key/value heads in place instead
of `repeat_interleave` copies of the cache (megatron's local attention; the fused `SDPAttention` reads them in
place itself), and skips the autograd Functions of linear layers and TP regions under no_grad; all exact
(tests/dist/test_generate.py compares with megatron's unpatched code).

Code: `generate_static` plans the slot layout (`kv_cache.plan_kv_cache`), then, with the KV cache held by a
`kv_cache.KVCacheModel` (or the `EngineOptions.kv_cache_model` given; by default `cuda_graph.engine_class` picks it
for the device), prefills and decodes (`_decode`: one `_TokenPicker.pick` and `_DecodeState.record` a slot) and lays
the responses out into a `Rollout` (`_finish`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core.utils import get_model_config

from mindspeed_llm import device as _device
from mindspeed_llm.inference import cuda_graph
from mindspeed_llm.inference.engine_inputs import group_max, place_prompts, response_uniforms, source_rank
from mindspeed_llm.inference.kv_cache import KVCacheModel, KVCachePlan, plan_kv_cache
from mindspeed_llm.inference.results import Rollout
from mindspeed_llm.inference.sampling import SamplingConfig, choose_tokens
from mindspeed_llm.models.sequence_parallel import sequence_parallel_off


def generate_static(model, prompts: List[List[int]], budgets: List[int], sampling: SamplingConfig, iteration: int,
                    sample_ids: Optional[Sequence[int]], vocab_size: Optional[int], record_routing: bool,
                    batched: bool, share_prefill: bool, kv_cache_model: Optional[Callable[..., KVCacheModel]],
                    peers, dev) -> Rollout:
    """`generate` on the static engine (`batched`: the left-padded one-shot prefill, else the stepwise one)."""
    plan = plan_kv_cache(prompts, budgets, batched=batched, share_prefill=share_prefill, device=dev)
    if peers is not None:  # as many decode slots as the expert-parallel peer with the most (see _decode)
        _check_allgather_shapes(model, plan, len(prompts), peers)
        steps = group_max(plan.slots - plan.first_step, peers)
        if steps > plan.slots - plan.first_step:
            plan = plan_kv_cache(prompts, budgets, batched=batched, share_prefill=share_prefill, device=dev,
                         decode_slots=steps)
    state = _DecodeState.start(plan, prompts, sampling)
    uniforms = response_uniforms(sampling, [iteration] * len(prompts), sample_ids, len(prompts),
                                 plan.max_response, dev)
    group, source = source_rank()
    make_engine = kv_cache_model or cuda_graph.engine_class(dev)
    # --sequence-parallel: generation runs the plain tensor-parallel model (models/sequence_parallel.py)
    with sequence_parallel_off(model):
        engine = make_engine(model, plan, record_routing)
        picker = _TokenPicker(sampling, uniforms, plan.starts, vocab_size, engine.last_stage, source, group)
        stats = dict(decode_forwards=0, decode_row_steps=0, finished_row_steps=0)
        try:
            with torch.no_grad():
                engine.prepare(state.tokens)
                _decode(engine, plan, state, picker, peers, stats)
        finally:
            engine.release()
    slot_routing = engine.routing
    stats.update(kv_cache_bytes=engine.cache_bytes, kv_rows=len(prompts), kv_slots=plan.slots)
    del engine  # the KV cache's memory returns to the allocator, for the training passes
    result = _finish(prompts, plan, state, sampling)
    result.stats = stats
    if slot_routing is not None:
        result.routing = _routing_by_position(slot_routing, plan, state)
    return result


# ---------------------------------------------------------------------------------------------- decode state
@dataclass
class _DecodeState:
    """The slots' tokens and what each row has generated so far; when a row stops (EOS, stop id, budget)."""

    tokens: torch.Tensor  # [B, T] the prompts at their planned slots, then the generated tokens
    log_probs: Optional[torch.Tensor]  # [B, T] log-prob of each generated token; None: not asked for
    response_lengths: torch.Tensor  # [B]
    finished: torch.Tensor  # [B] bool
    reason_eos: torch.Tensor  # [B] bool: stopped at an EOS id
    reason_stop: torch.Tensor  # [B] bool: stopped at a stop id that is not an EOS id
    budgets: torch.Tensor  # [B] the most tokens each row may generate
    eos_ids: torch.Tensor
    stop_ids: torch.Tensor

    @classmethod
    def start(cls, plan: KVCachePlan, prompts: List[List[int]], sampling: SamplingConfig) -> "_DecodeState":
        """Nothing generated yet; rows with a zero budget are finished from the start."""
        dev = plan.starts.device
        B, T = len(prompts), plan.slots
        return cls(
            tokens=place_prompts(prompts, plan.offsets, T, sampling.pad_id, dev),
            log_probs=torch.zeros((B, T), dtype=torch.float32, device=dev) if sampling.return_log_probs else None,
            response_lengths=torch.zeros(B, dtype=torch.long, device=dev),
            finished=plan.budgets == 0,
            reason_eos=torch.zeros(B, dtype=torch.bool, device=dev),
            reason_stop=torch.zeros(B, dtype=torch.bool, device=dev),
            budgets=plan.budgets,
            eos_ids=torch.tensor(sampling.eos_ids, dtype=torch.long, device=dev),
            stop_ids=torch.tensor(sampling.stop_ids, dtype=torch.long, device=dev),
        )

    def all_finished(self) -> bool:
        """Whether every row has stopped (a host sync)."""
        return bool(self.finished.all())

    def record(self, pos: int, generating: torch.Tensor, new_tokens: torch.Tensor,
               new_log_probs: Optional[torch.Tensor]) -> None:
        """Writes slot `pos`'s tokens (and log-probs) of the `generating` rows and finishes the rows that stop."""
        self.tokens[:, pos] = torch.where(generating, new_tokens, self.tokens[:, pos])
        if self.log_probs is not None:
            self.log_probs[:, pos] = torch.where(generating, new_log_probs, self.log_probs[:, pos])
        self.response_lengths += generating.long()
        hit_eos = generating & torch.isin(new_tokens, self.eos_ids)
        hit_stop = generating & torch.isin(new_tokens, self.stop_ids) & ~hit_eos
        self.reason_eos |= hit_eos
        self.reason_stop |= hit_stop
        self.finished |= hit_eos | hit_stop | (generating & (self.response_lengths >= self.budgets))


# ---------------------------------------------------------------------------------------------- token choice
@dataclass
class _TokenPicker:
    """Chooses a slot's tokens (and log-probs) on the last stage and broadcasts them from the source rank, so
    that every rank of the model-parallel group feeds and records the same tokens."""

    sampling: SamplingConfig
    uniforms: Optional[torch.Tensor]  # [B, R_max]: row b's j-th response token is drawn with uniforms[b, j]
    starts: torch.Tensor  # [B] slot of each row's first response token
    vocab_size: Optional[int]  # ids >= vocab_size are never chosen
    last_stage: bool
    source: Optional[int]  # global rank that chooses for the group; None: no model parallelism
    group: object  # the model-parallel group
    rows: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.rows = torch.arange(self.starts.numel(), device=self.starts.device)

    def pick(self, logits: Optional[torch.Tensor], pos: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Tokens [B] (+ log-probs [B]) for slot `pos`; `logits` are the last stage's (None elsewhere)."""
        new_tokens = new_log_probs = None
        if self.last_stage:
            u = None
            if self.uniforms is not None:
                u = self.uniforms[self.rows, (pos - self.starts).clamp(0, self.uniforms.size(1) - 1)]
            new_tokens, new_log_probs = choose_tokens(logits, self.sampling, u, sample_below=self.vocab_size,
                                                      with_log_probs=self.sampling.return_log_probs)
        if self.source is None:
            return new_tokens, new_log_probs
        return self._broadcast(new_tokens, new_log_probs)

    def _broadcast(self, new_tokens: Optional[torch.Tensor], new_log_probs: Optional[torch.Tensor]):
        """The source rank's tokens (+ log-probs), packed into one float64 tensor for a single broadcast."""
        with_log_probs = self.sampling.return_log_probs
        packed = torch.empty((2 if with_log_probs else 1, self.starts.numel()), dtype=torch.float64,
                             device=self.starts.device)
        if dist.get_rank() == self.source:
            packed[0] = new_tokens.to(torch.float64)
            if with_log_probs:
                packed[1] = new_log_probs.to(torch.float64)
        dist.broadcast(packed, src=self.source, group=self.group)
        return packed[0].long(), (packed[1].float() if with_log_probs else None)


# ---------------------------------------------------------------------------------------------- loop and result
def _check_allgather_shapes(model, plan: KVCachePlan, batch_size: int, peers) -> None:
    """Megatron's all-gather token dispatcher gathers equal-sized token blocks from the expert-parallel ranks: the
    prefill and decode forwards must hold as many tokens on each. Refuses (on every rank) when they would not."""
    if getattr(get_model_config(model), "moe_token_dispatcher_type", None) != "allgather":
        return
    prefill_rows = batch_size if plan.unique_rows is None else plan.unique_rows.numel()
    shape = torch.tensor([prefill_rows * plan.first_step, batch_size], dtype=torch.long,
                         device=_device.current_device())
    spread = torch.cat([shape, -shape])
    dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=peers)
    if bool((spread[:2] != -spread[2:]).any()):
        raise ValueError(
            "generate: the expert-parallel ranks hold rollouts of different shapes (prefill tokens "
            f"{-int(spread[2])}..{int(spread[0])}, batch {-int(spread[3])}..{int(spread[1])}), which megatron's "
            "all-gather token dispatcher cannot exchange; use --moe-token-dispatcher-type alltoall with "
            "--expert-model-parallel-size > 1")


def _all_finished(state: _DecodeState, peers) -> bool:
    """Every row has stopped, here and (at EP > 1) on every expert-parallel peer."""
    if peers is None:
        return state.all_finished()
    return group_max(int(not state.all_finished()), peers) == 0


def _decode(engine: KVCacheModel, plan: KVCachePlan, state: _DecodeState, picker: _TokenPicker, peers=None,
            stats: Optional[dict] = None) -> None:
    """Prefills, then picks one slot's tokens per step and runs that slot, until every row has stopped (on every
    expert-parallel peer too, `engine_inputs.expert_peers`). `stats` counts the decode forwards, their rows and the
    rows among them that had already stopped."""
    stats = {} if stats is None else stats
    if _all_finished(state, peers):  # every budget is 0: nothing to run
        return
    logits = engine.prefill(state.tokens)
    for pos in range(plan.first_step, plan.slots):
        generating = (plan.starts <= pos) & ~state.finished
        if bool(generating.any()):  # stepwise prefill: the unfinished rows may all be inside their prompts
            new_tokens, new_log_probs = picker.pick(logits, pos)
            state.record(pos, generating, new_tokens, new_log_probs)
        if _all_finished(state, peers):
            break
        stats["decode_forwards"] = stats.get("decode_forwards", 0) + 1
        stats["decode_row_steps"] = stats.get("decode_row_steps", 0) + state.finished.numel()
        stats["finished_row_steps"] = stats.get("finished_row_steps", 0) + int(state.finished.sum())
        logits = engine.decode_step(state.tokens, pos)


def _finish(prompts: List[List[int]], plan: KVCachePlan, state: _DecodeState, sampling: SamplingConfig) -> Rollout:
    """Gathers each row's response slots into the `Rollout` layout (pad and mask 0 after its last token)."""
    dev = plan.starts.device
    pad = sampling.pad_id
    j = torch.arange(plan.max_response, device=dev).unsqueeze(0)
    idx = (plan.starts.unsqueeze(1) + j).clamp(max=plan.slots - 1)
    response_mask = (j < state.response_lengths.unsqueeze(1)).long()
    responses = torch.where(response_mask.bool(), state.tokens.gather(1, idx), torch.full_like(idx, pad))
    log_probs = state.log_probs.gather(1, idx) * response_mask if state.log_probs is not None else None
    reasons = ["eos" if e else "stop" if s else "length"
               for e, s in zip(state.reason_eos.tolist(), state.reason_stop.tolist())]
    return Rollout(
        prompts=place_prompts(prompts, [0] * len(prompts), plan.max_prompt, pad, dev),
        prompt_lengths=plan.prompt_lengths,
        responses=responses,
        response_mask=response_mask,
        response_lengths=state.response_lengths,
        ended_with_eos=state.reason_eos.clone(),
        finish_reasons=reasons,
        log_probs=log_probs,
        pad_token_id=pad,
        seed=sampling.seed if sampling.do_sample else None,
    )


def _routing_by_position(slot_routing: torch.Tensor, plan: KVCachePlan, state: _DecodeState) -> torch.Tensor:
    """The KV-cache slots' routing `[B, layers, slots, topk]` in the Rollout's right-padded layout
    `[B, layers, max(L_b + r_b), topk]`: the prompt's and response's tokens at their positions, -1 on padding and
    where the token never ran (a response's last token when the batch stopped right after it)."""
    B, layers, slots, topk = slot_routing.shape
    total = plan.prompt_lengths + state.response_lengths
    width = max(int(total.max()), 1)
    s = torch.arange(slots, device=slot_routing.device)[None, :]
    offsets = torch.tensor(plan.offsets, dtype=torch.long, device=slot_routing.device)[:, None]
    real = (s >= offsets) & (s < (plan.starts + state.response_lengths)[:, None])  # prompt and response slots
    out = torch.full((B, width, layers, topk), -1, dtype=slot_routing.dtype, device=slot_routing.device)
    b, slot = real.nonzero(as_tuple=True)
    out[b, plan.position_ids[b, slot]] = slot_routing.permute(0, 2, 1, 3)[b, slot]
    return out.permute(0, 2, 1, 3).contiguous()
