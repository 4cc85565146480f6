"""Rollout generation on Megatron-core's own inference path with its static KV cache.

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
  `transformers` does with left padding). Needs attention that honours an explicit mask: Megatron's
  local (unfused-softmax) attention without a sliding window, which is how `mindspeed_llm.models` builds.
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
`materialize_only_last_token_logits`). On the CPU, `mindspeed_llm/patches/inference.py` makes each decode step
cost O(new tokens) in rotary work instead of O(cached tokens), reads grouped key/value heads in place instead
of `repeat_interleave` copies of the cache, and skips the autograd Functions of linear layers and TP regions under
no_grad; all exact (tests/test_generate.py compares with megatron's unpatched code).

Parallelism: the logits come out of the last pipeline stage already gathered over tensor parallelism
(`runtime_gather_output=True`). The last stage picks the tokens and broadcasts them (with their log-probs)
to every rank of the model-parallel group (all TP x PP ranks of this DP replica) from one source rank (last
stage, TP rank 0), so all ranks of a replica feed the same tokens and return the same `Rollout`. Pipeline
stages exchange hidden states through the wrapper's p2p send/recv. The prompts must be the same on every
rank of a model-parallel group (they normally come from the DP rank's data shard).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.inference.communication_utils import is_pipeline_last_stage
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.utils import get_attr_wrapped_model, get_model_config, unwrap_model

from mindspeed_llm import device as _device
from mindspeed_llm.inference.rollout import Rollout
from mindspeed_llm.inference.sampling import SamplingConfig, choose_tokens, sample_uniforms

PREFILL_MODES = ("auto", "batched", "stepwise")


def _model_parallel_source(group) -> Optional[int]:
    """Global rank that samples for this model-parallel group: the last PP stage's TP rank 0."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    is_source = (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
    )
    mine = torch.tensor([dist.get_rank() if is_source else -1], dtype=torch.long,
                        device=_device.current_device())
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    return int(mine.item())


def _default_dp_rank() -> int:
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_rank()
    return 0


def batched_prefill_blocker(config) -> Optional[str]:
    """Why `prefill="batched"` cannot run on a model with this TransformerConfig (None: it can)."""
    if config.attention_backend != AttnBackend.local:
        return f"attention_backend={config.attention_backend.name} ignores explicit masks (needs local)"
    if config.masked_softmax_fusion:
        return "masked_softmax_fusion=True: the fused causal softmax ignores explicit masks"
    if getattr(config, "window_size", None) is not None:
        return "window_size is set: sliding-window attention builds its own mask"
    return None


def generate(
    model,
    prompt_token_lists: Sequence[Sequence[int]],
    sampling: Optional[SamplingConfig] = None,
    *,
    iteration: int = 0,
    sample_ids: Optional[Sequence[int]] = None,
    vocab_size: Optional[int] = None,
    prefill: str = "auto",
    _dedup_prefill: bool = True,
) -> Rollout:
    """Generate one response per prompt with Megatron's KV cache; returns a `Rollout` (same on every rank
    of the model-parallel group).

    Args:
        model: this rank's Megatron `GPTModel` (optionally wrapped in DDP / Float16Module; not a list, no
            virtual pipeline). Its train/eval mode is restored afterwards and the KV cache freed.
        prompt_token_lists: B prompts as token-id lists (each non-empty), in any mix of lengths.
        sampling: `SamplingConfig` (default: greedy, 128 new tokens, no EOS).
        iteration, sample_ids: row b's tokens are drawn from the uniform stream of sample `sample_ids[b]`
            (`sample_uniforms(sampling.seed, iteration, ...)`): the same sample id and iteration sample the
            same response on any rank, in any row and batch. Give every sample of a global batch its own id
            (the stages use its position in the global batch); the default, dp_rank * B + b with Megatron's
            data-parallel rank, keeps DP replicas apart. Pass the RL iteration as `iteration` for fresh
            samples each step.
        vocab_size: if the model's vocabulary is padded, logits at ids >= vocab_size are never chosen (the
            returned log-probs still normalise over the whole padded vocabulary, as a training forward does).
        prefill: "batched" (left-padded one-shot prefill), "stepwise" (Megatron controller's scheme) or
            "auto" (batched where the attention honours masks, else stepwise); see the module docstring.
        _dedup_prefill: private; False prefills every row even where prompts repeat (tests compare both).
    """
    sampling = sampling or SamplingConfig()
    prompts = [[int(t) for t in p] for p in prompt_token_lists]
    if not prompts:
        raise ValueError("generate: no prompts")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: empty prompt; every prompt needs at least one token (e.g. BOS)")
    if isinstance(model, (list, tuple)):
        raise NotImplementedError(
            "generate: got a list of model chunks; virtual pipeline parallelism "
            "(--num-layers-per-virtual-pipeline-stage) is not supported for generation"
        )
    if prefill not in PREFILL_MODES:
        raise ValueError(f"generate: prefill={prefill!r}; choose one of {PREFILL_MODES}")
    core_model = unwrap_model(model)
    if getattr(core_model, "is_value_model", False):
        raise ValueError("generate: this is a value-head model (critic/reward); it has no logits")
    config = get_model_config(model)
    blocker = batched_prefill_blocker(config)
    if prefill == "batched" and blocker:
        raise ValueError(f"generate: prefill='batched' is not possible: {blocker}; use prefill='stepwise'")
    batched = prefill == "batched" or (prefill == "auto" and blocker is None)

    dev = _device.current_device()
    pad = sampling.pad_id
    B = len(prompts)
    lengths = [len(p) for p in prompts]
    budgets = sampling.response_budgets(lengths)
    L_min, L_max, R_max = min(lengths), max(lengths), max(budgets)
    prompt_lengths = torch.tensor(lengths, dtype=torch.long, device=dev)
    budget_t = torch.tensor(budgets, dtype=torch.long, device=dev)

    # ---------------------------------------------------------------- KV-cache slot layout
    # Row b's prompt occupies slots [offset_b, offset_b + L_b); its j-th response token slot start_b + j.
    if batched:
        T = L_max + R_max
        offsets = L_max - prompt_lengths
        starts = torch.full((B,), L_max, dtype=torch.long, device=dev)
        first_step = L_max
    else:
        T = max(L + R for L, R in zip(lengths, budgets))
        offsets = torch.zeros(B, dtype=torch.long, device=dev)
        starts = prompt_lengths
        first_step = L_min
    tokens = torch.full((B, T), pad, dtype=torch.long, device=dev)
    prompt_tensor = torch.full((B, L_max), pad, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        row = torch.tensor(p, dtype=torch.long, device=dev)
        o = int(offsets[b])
        tokens[b, o: o + len(p)] = row
        prompt_tensor[b, : len(p)] = row
    # Rows whose prefill window is identical (GRPO repeats each prompt n times) share one prefill row.
    # Batched: the whole prompt (its left padding follows from its length). Stepwise: the first L_min tokens.
    share_index = None
    if _dedup_prefill:
        unique_of, share, unique_rows = {}, [], []
        for b, p in enumerate(prompts):
            key = tuple(p if batched else p[:L_min])
            if key not in unique_of:
                unique_of[key] = len(unique_rows)
                unique_rows.append(b)
            share.append(unique_of[key])
        if len(unique_rows) < B:
            share_index = torch.tensor(share, dtype=torch.long, device=dev)  # row -> its prefill row
            unique_rows = torch.tensor(unique_rows, dtype=torch.long, device=dev)
    slots = torch.arange(T, device=dev)
    position_ids = (slots.unsqueeze(0) - offsets.unsqueeze(1)).clamp(min=0)  # true positions (rope ignores)
    key_is_pad = (slots.unsqueeze(0) < offsets.unsqueeze(1)).view(B, 1, 1, T)  # True = masked (megatron)

    # ---------------------------------------------------------------- sampling state
    uniforms = None  # [B, R_max]: row b's j-th response token is drawn with uniforms[b, j]
    if sampling.do_sample:
        if sample_ids is None:
            sample_ids = range(_default_dp_rank() * B, (_default_dp_rank() + 1) * B)
        if len(sample_ids) != B:
            raise ValueError(f"generate: {len(sample_ids)} sample_ids for {B} prompts")
        uniforms = torch.from_numpy(sample_uniforms(sampling.seed, iteration, sample_ids, max(R_max, 1))).to(dev)
    eos_t = torch.tensor(sampling.eos_ids, dtype=torch.long, device=dev)
    stop_t = torch.tensor(sampling.stop_ids, dtype=torch.long, device=dev)
    response_lengths = torch.zeros(B, dtype=torch.long, device=dev)
    finished = budget_t == 0
    reason_eos = torch.zeros(B, dtype=torch.bool, device=dev)
    reason_stop = torch.zeros(B, dtype=torch.bool, device=dev)
    want_log_probs = sampling.return_log_probs
    log_probs = torch.zeros((B, T), dtype=torch.float32, device=dev) if want_log_probs else None

    mp_group = parallel_state.get_model_parallel_group() if parallel_state.model_parallel_is_initialized() else None
    source = _model_parallel_source(mp_group)

    # ---------------------------------------------------------------- megatron inference wrapper + KV cache
    wrapper_config = InferenceWrapperConfig(
        hidden_size=config.hidden_size,
        params_dtype=config.params_dtype,
        inference_batch_times_seqlen_threshold=-1,  # whole batch per pipeline step, no micro-batching
        padded_vocab_size=int(getattr(core_model, "vocab_size", 0) or 0),
        inference_max_requests=B,
        inference_max_seq_length=T,
        fp32_residual_connection=config.fp32_residual_connection,
    )
    context = StaticInferenceContext(max_batch_size=B, max_sequence_length=T)
    wrapper = GPTInferenceWrapper(model, wrapper_config, context)
    last_stage = is_pipeline_last_stage(wrapper.pp_group)
    was_training = model.training

    def forward(start: int, end: int, rows: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Run slots [start, end) (KV cache offset = start) for every row, or only for `rows` (which then fill
        cache rows 0 .. len(rows)-1); logits [B or len(rows), V] of slot end-1 on the last stage."""
        window_tokens, window_positions = tokens[:, start:end], position_ids[:, start:end]
        if rows is not None:
            window_tokens, window_positions = window_tokens[rows], window_positions[rows]
        if batched:
            mask = (key_is_pad if rows is None else key_is_pad[rows])[..., :end]
            if end - start > 1:  # prefill: causal within the window as well
                causal = torch.ones((end - start, end), dtype=torch.bool, device=dev).triu(1 + start)
                mask = mask | causal.view(1, 1, end - start, end)
        else:
            mask = stepwise_mask[..., start:end, :end]  # [1, 1, ., .]: the same for every row
        window = {"tokens": window_tokens, "position_ids": window_positions, "attention_mask": mask}
        if wrapper.model_is_pipeline_parallel:
            out = wrapper.forward_pass_with_pipeline_parallel_small_input_batch(window)
        else:
            out = wrapper.forward_pass_without_pipeline_parallel(window)
        return out[:, -1, :] if out is not None else None

    def prefill_forward() -> Optional[torch.Tensor]:
        """Slots [0, first_step) of every row; with repeated prompts, one forward over the unique ones, whose
        KV-cache rows and logits are then copied to the rows that repeat them (a copy of what their own
        forward would compute: the rows of a batch never mix)."""
        if share_index is None:
            return forward(0, first_step)
        logits = forward(0, first_step, unique_rows)
        for buffers in context.key_value_memory_dict.values():  # this stage's layers: [T, B, groups, dim]
            for buf in buffers:
                if buf is not None:
                    buf[:first_step, :B] = buf[:first_step, share_index]
        return logits[share_index] if logits is not None else None

    rows = torch.arange(B, device=dev)

    def pick(logits: Optional[torch.Tensor], pos: int):
        """Tokens (+ log-probs) for slot `pos`, chosen on the source rank and broadcast to the model-parallel
        group."""
        new_tokens = new_lp = None
        if last_stage:
            u = None if uniforms is None else uniforms[rows, (pos - starts).clamp(0, uniforms.size(1) - 1)]
            new_tokens, new_lp = choose_tokens(logits, sampling, u, with_log_probs=want_log_probs,
                                               sample_below=vocab_size)
        if source is None:
            return new_tokens, new_lp
        packed = torch.empty((2 if want_log_probs else 1, B), dtype=torch.float64, device=dev)
        if dist.get_rank() == source:
            packed[0] = new_tokens.to(torch.float64)
            if want_log_probs:
                packed[1] = new_lp.to(torch.float64)
        dist.broadcast(packed, src=source, group=mp_group)
        return packed[0].long(), (packed[1].float() if want_log_probs else None)

    try:
        with torch.no_grad():
            wrapper.prep_model_for_inference()  # eval(), context.reset(), PP detection
            if not batched:
                stepwise_mask = wrapper.prep_inference_input(tokens)["attention_mask"]
            pos = first_step
            if not bool(finished.all()):  # else every budget is 0: nothing to run
                logits = prefill_forward()
            while pos < T and not bool(finished.all()):
                generating = (starts <= pos) & ~finished
                if bool(generating.any()):
                    new_tokens, new_lp = pick(logits, pos)
                    tokens[:, pos] = torch.where(generating, new_tokens, tokens[:, pos])
                    if want_log_probs:
                        log_probs[:, pos] = torch.where(generating, new_lp, log_probs[:, pos])
                    response_lengths += generating.long()
                    hit_eos = generating & torch.isin(new_tokens, eos_t)
                    hit_stop = generating & torch.isin(new_tokens, stop_t) & ~hit_eos
                    reason_eos |= hit_eos
                    reason_stop |= hit_stop
                    finished |= hit_eos | hit_stop | (generating & (response_lengths >= budget_t))
                if bool(finished.all()):
                    break
                if pos >= L_max:
                    context.enable_decode_mode()  # the token fed next is a generated one in every row
                logits = forward(pos, pos + 1)
                pos += 1
    finally:
        context.key_value_memory_dict.clear()
        context.reset()
        set_input_tensor = get_attr_wrapped_model(model, "set_input_tensor")
        set_input_tensor(None)
        model.train(was_training)
        del wrapper, context  # the KV cache's memory returns to the allocator, for the training passes

    # ---------------------------------------------------------------- response layout
    j = torch.arange(R_max, device=dev).unsqueeze(0)
    idx = (starts.unsqueeze(1) + j).clamp(max=T - 1)
    response_mask = (j < response_lengths.unsqueeze(1)).long()
    responses = torch.where(response_mask.bool(), tokens.gather(1, idx), torch.full_like(idx, pad))
    resp_log_probs = log_probs.gather(1, idx) * response_mask if want_log_probs else None
    reasons = ["eos" if e else "stop" if s else "length" for e, s in zip(reason_eos.tolist(), reason_stop.tolist())]
    return Rollout(
        prompts=prompt_tensor,
        prompt_lengths=prompt_lengths,
        responses=responses,
        response_mask=response_mask,
        response_lengths=response_lengths,
        ended_with_eos=reason_eos.clone(),
        finish_reasons=reasons,
        log_probs=resp_log_probs,
        pad_token_id=pad,
        seed=sampling.seed if sampling.do_sample else None,
    )


__all__ = ["generate", "batched_prefill_blocker", "PREFILL_MODES"]
