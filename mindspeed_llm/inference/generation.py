"""Rollout generation: `generate` and its two engines.

* `engine="continuous"` (the default where it can run, `engine="auto"`): `inference/continuous.py`, continuous
  batching over its own bounded KV cache (`SamplingConfig.max_num_seqs` rows in flight, a finished row's slot takes
  the next sample, pipeline stages busy with micro-batch groups, partial rollouts via `max_decode_steps` /
  `continuations`). Its tokens equal the static engine's.
* `engine="static"`: megatron's `GPTInferenceWrapper` + `StaticInferenceContext`, the whole batch in lock-step; the
  reference, the stepwise prefill and the CUDA-graph decode step (`cuda_graph.py`); its KV cache and slot plan are
  `kv_cache.py`'s. The rest of this docstring describes it.

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

Parallelism: the logits come out of the last pipeline stage already gathered over tensor parallelism
(`runtime_gather_output=True`). The last stage picks the tokens and broadcasts them (with their log-probs)
to every rank of the model-parallel group (all TP x PP ranks of this DP replica) from one source rank (last
stage, TP rank 0), so all ranks of a replica feed the same tokens and return the same `Rollout`. Pipeline
stages exchange hidden states through the wrapper's p2p send/recv. The prompts must be the same on every
rank of a model-parallel group (they normally come from the DP rank's data shard). Both engines: under
`--sequence-parallel` the model runs without it here (`models/sequence_parallel.py`); under context parallelism
each CP rank generates its own prompts (the model is built without CP, `models/context_parallel.py`), the CP group
does not enter generation.

Code: `generate` checks its inputs and picks the engine (`_choose_engine`); the continuous one runs in
`_generate_continuous`. The static one plans the slot layout (`kv_cache.plan_kv_cache`), then, with the KV cache held
by a `kv_cache.KVCacheModel` (or the `static_engine` given; by default `cuda_graph.engine_class` picks it for the
device), prefills and decodes (`_decode`: one `_TokenPicker.pick` and `_DecodeState.record` a slot) and
lays the responses out into a `Rollout` (`_finish`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnBackend
from megatron.core.utils import get_model_config, unwrap_model

from mindspeed_llm import device as _device
from mindspeed_llm.inference import continuous, cuda_graph
from mindspeed_llm.inference.kv_cache import KVCacheModel, KVCachePlan, plan_kv_cache
from mindspeed_llm.inference.results import Continuation, Rollout
from mindspeed_llm.models.attention import model_attention
from mindspeed_llm.models.sequence_parallel import sequence_parallel_off
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
    """Megatron's data-parallel rank, 0 without Megatron's parallel state."""
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_rank()
    return 0


def batched_prefill_blocker(model) -> Optional[str]:
    """Why `prefill="batched"` cannot run on `model` (None: it can): its core attention must honour explicit masks,
    as both of `mindspeed_llm.models`' do (the fused `SDPAttention`, megatron's local attention without a fused
    softmax or a sliding window)."""
    config = get_model_config(model)
    if config.attention_backend != AttnBackend.local:
        return f"attention_backend={config.attention_backend.name} ignores explicit masks (needs local)"
    if model_attention(model) == "sdpa":  # models/attention.py: masks as given, no sliding window (refused there)
        return None
    if config.masked_softmax_fusion:
        return "masked_softmax_fusion=True: the fused causal softmax ignores explicit masks"
    if getattr(config, "window_size", None) is not None:
        return "window_size is set: sliding-window attention builds its own mask"
    return None


ENGINES = ("auto", "continuous", "static")


def generate(
    model,
    prompt_token_lists: Sequence[Sequence[int]],
    sampling: Optional[SamplingConfig] = None,
    *,
    iteration: int = 0,
    sample_ids: Optional[Sequence[int]] = None,
    vocab_size: Optional[int] = None,
    prefill: str = "auto",
    record_routing: bool = False,
    engine: str = "auto",
    max_decode_steps: Optional[int] = None,
    continuations: Optional[Sequence[Optional[Continuation]]] = None,
    response_budgets: Optional[Sequence[int]] = None,
    static_engine: Optional[Callable[..., KVCacheModel]] = None,
    _dedup_prefill: bool = True,
    _pipeline_groups: Optional[int] = None,
) -> Rollout:
    """Generate one response per prompt; returns a `Rollout` (same on every rank of the model-parallel group).

    Args:
        model: this rank's Megatron `GPTModel` (optionally wrapped in DDP / Float16Module; not a list, no
            virtual pipeline). Its train/eval mode is restored afterwards and the KV cache freed.
        prompt_token_lists: B prompts as token-id lists (each non-empty), in any mix of lengths.
        sampling: `SamplingConfig` (default: greedy, 128 new tokens, no EOS; its `max_num_seqs` /
            `max_num_batched_tokens` bound the continuous engine).
        iteration, sample_ids: row b's tokens are drawn from the uniform stream of sample `sample_ids[b]`
            (`sample_uniforms(sampling.seed, iteration, ...)`): the same sample id and iteration sample the
            same response on any rank, in any row and batch. Give every sample of a global batch its own id
            (the stages use its position in the global batch); the default, dp_rank * B + b with Megatron's
            data-parallel rank, keeps DP replicas apart. Pass the RL iteration as `iteration` for fresh
            samples each step.
        vocab_size: if the model's vocabulary is padded, logits at ids >= vocab_size are never chosen (the
            returned log-probs still normalise over the whole padded vocabulary, as a training forward does).
        prefill: the static engine's prefill: "batched" (left-padded one-shot prefill), "stepwise" (Megatron
            controller's scheme) or "auto" (batched where the attention honours masks, else stepwise); see the
            module docstring. "stepwise" selects the static engine under `engine="auto"`.
        record_routing: a mixture of experts records each token's top-k experts in every MoE layer of this
            rank into `Rollout.routing` (`mindspeed_llm.models.routing`); nothing for a dense model.
        engine: "continuous" (`inference/continuous.py`: rows in flight bounded by `sampling.max_num_seqs`, a
            finished row's slot takes the next sample), "static" (megatron's static KV cache, the whole batch in
            lock-step; the reference, and the CUDA-graph decode) or "auto": continuous where it can run (attention
            that honours explicit masks, no `prefill="stepwise"`, no CUDA-graph switch, no all-gather token
            dispatcher at EP > 1), else static.
        max_decode_steps: continuous engine: each group of rows in flight (one, or one per pipeline stage) runs
            at most this many decode steps; samples not done then are returned "unfinished", with
            `Rollout.continuations` to carry them on (partial rollouts).
        continuations: continuous engine: per row None (a fresh sample) or a `Continuation` of this row's prompt
            (from an earlier call's `Rollout.continuations`): its old response is prefilled and kept with its
            log-probs, its tokens continue the stream of `Continuation.iteration`, and its budget counts the old
            tokens.
        response_budgets: per row the most response tokens (default: `sampling.response_budgets` of the prompt
            lengths); a continuation's old tokens count.
        static_engine: the static engine's KV-cache model, called as `static_engine(model, plan, record_routing)`
            with the batch's `KVCachePlan` (`inference/kv_cache.py`); default: what `cuda_graph.engine_class` picks
            for the device (`KVCacheModel`, or the fixed-shape CUDA-graph step where MINDSPEED_DECODE_CUDA_GRAPH=1
            on CUDA). Tests and benchmarks pass `cuda_graph.StaticDecodeKVCacheModel` (or a subclass). Given, it
            selects the static engine under `engine="auto"` (`engine="continuous"` refuses it).
        _dedup_prefill: private; False prefills every row even where prompts repeat (tests compare both).
        _pipeline_groups: private; the continuous engine's number of row groups (default: the pipeline size;
            1: the whole batch passes the stages in turn, for tests).
    """
    sampling = sampling or SamplingConfig()
    prompts = _checked_prompts(prompt_token_lists)
    batched = _use_batched_prefill(model, prefill)
    dev = _device.current_device()
    budgets = _budgets(sampling, prompts, response_budgets)
    peers = _expert_peers(model)
    chosen = _choose_engine(model, engine, prefill, batched, sampling, dev, peers,
                            dict(max_decode_steps=max_decode_steps, continuations=continuations,
                                 _pipeline_groups=_pipeline_groups), static_engine is not None)
    if chosen == "continuous":
        # --sequence-parallel: as the static engine below, the plain tensor-parallel model (models/sequence_parallel.py)
        with sequence_parallel_off(model):
            return _generate_continuous(model, prompts, budgets, sampling, iteration, sample_ids, vocab_size,
                                        record_routing, max_decode_steps, continuations, _dedup_prefill,
                                        _pipeline_groups, peers, dev)
    plan = plan_kv_cache(prompts, budgets, batched=batched, share_prefill=_dedup_prefill, device=dev)
    if peers is not None:  # as many decode slots as the expert-parallel peer with the most (see _decode)
        _check_allgather_shapes(model, plan, len(prompts), peers)
        steps = _group_max(plan.slots - plan.first_step, peers)
        if steps > plan.slots - plan.first_step:
            plan = plan_kv_cache(prompts, budgets, batched=batched, share_prefill=_dedup_prefill, device=dev,
                         decode_slots=steps)
    state = _DecodeState.start(plan, prompts, sampling)
    uniforms = _response_uniforms(sampling, [iteration] * len(prompts), sample_ids, len(prompts),
                                  plan.max_response, dev)
    group, source = _source_rank()
    make_engine = static_engine or cuda_graph.engine_class(dev)
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


def _source_rank():
    """(the model-parallel group or None, the global rank that picks the tokens for it or None)."""
    group = parallel_state.get_model_parallel_group() if parallel_state.model_parallel_is_initialized() else None
    return group, _model_parallel_source(group)


def _choose_engine(model, engine: str, prefill: str, batched: bool, sampling: SamplingConfig, device, peers,
                   continuous_only: dict, static_engine_given: bool = False) -> str:
    """"continuous" or "static" for `engine` (see `generate`); raises where the choice cannot be honoured."""
    if engine not in ENGINES:
        raise ValueError(f"generate: engine={engine!r}; choose one of {ENGINES}")
    wanted = [name for name, value in continuous_only.items() if value is not None]
    wanted += [f"sampling.{name}" for name in ("max_num_seqs", "max_num_batched_tokens")
               if getattr(sampling, name) is not None]
    blockers = _continuous_blockers(model, prefill, batched, device, peers)
    if static_engine_given:
        blockers.append("static_engine is given (the static engine's KV-cache model)")
    if engine == "static" or (engine == "auto" and blockers):
        if wanted:
            why = "engine='static'" if engine == "static" else "the static engine runs here: " + "; ".join(blockers)
            raise ValueError(f"generate: {', '.join(wanted)} need the continuous engine, but {why}")
        return "static"
    if engine == "continuous" and blockers:
        raise ValueError("generate: engine='continuous' is not possible: " + "; ".join(blockers))
    return "continuous"


def continuous_engine_blockers(model) -> List[str]:
    """Why `generate(model, ...)` with its defaults (`engine="auto"`, `prefill="auto"`) would run the static engine
    here, which has no `continuations` (empty: it runs the continuous one)."""
    return _continuous_blockers(model, "auto", _use_batched_prefill(model, "auto"), _device.current_device(),
                                _expert_peers(model))


def _continuous_blockers(model, prefill: str, batched: bool, device, peers) -> List[str]:
    """What keeps the continuous engine from running `model` (empty: nothing)."""
    blockers = []
    if prefill == "stepwise":
        blockers.append("prefill='stepwise' is the static engine's scheme")
    if not batched and prefill != "stepwise":  # `_use_batched_prefill` asked `batched_prefill_blocker`
        blockers.append("its core attention ignores explicit masks (batched_prefill_blocker says why)")
    if cuda_graph.decode_cuda_graph_requested(device):
        blockers.append(f"{cuda_graph.DECODE_CUDA_GRAPH_ENV}=1 asks for the static engine's CUDA-graph decode step")
    if peers is not None and getattr(get_model_config(model), "moe_token_dispatcher_type", None) == "allgather":
        blockers.append("the all-gather token dispatcher at EP > 1 needs equal token counts per forward on the "
                        "expert-parallel ranks (use --moe-token-dispatcher-type alltoall)")
    return blockers


def _budgets(sampling: SamplingConfig, prompts: List[List[int]], response_budgets) -> List[int]:
    if response_budgets is None:
        return sampling.response_budgets([len(p) for p in prompts])
    budgets = [int(b) for b in response_budgets]
    if len(budgets) != len(prompts) or any(b < 0 for b in budgets):
        raise ValueError(f"generate: response_budgets needs one integer >= 0 per prompt ({len(prompts)}); got "
                         f"{list(response_budgets)}")
    return budgets


def _generate_continuous(model, prompts, budgets, sampling, iteration, sample_ids, vocab_size, record_routing,
                         max_decode_steps, continuations, share_prefill, pipeline_groups, peers, dev) -> Rollout:
    """`generate` on `inference/continuous.py`'s engine."""
    B = len(prompts)
    if max_decode_steps is not None and (isinstance(max_decode_steps, bool) or int(max_decode_steps) < 1):
        raise ValueError(f"generate: max_decode_steps={max_decode_steps!r} must be an integer >= 1")
    if pipeline_groups is not None and int(pipeline_groups) < 1:
        raise ValueError(f"generate: _pipeline_groups={pipeline_groups!r} must be >= 1")
    continuations = list(continuations) if continuations is not None else [None] * B
    if len(continuations) != B:
        raise ValueError(f"generate: {len(continuations)} continuations for {B} prompts")
    stops = set(sampling.eos_ids) | set(sampling.stop_ids)
    samples, iterations = [], []
    for b, (prompt, carry, budget) in enumerate(zip(prompts, continuations, budgets)):
        carried = [int(t) for t in carry.response] if carry is not None else []
        if carried and carried[-1] in stops:
            raise ValueError(f"generate: continuation {b} already ends with an EOS / stop token; it is finished")
        if carry is not None and carry.log_probs is not None and len(carry.log_probs) != len(carried):
            raise ValueError(f"generate: continuation {b} has {len(carry.log_probs)} log-probs for "
                             f"{len(carried)} tokens")
        sample = continuous.Sample(prompt + carried, len(prompt), budget)
        if sample.response_length >= budget:
            sample.reason = "length"
        samples.append(sample)
        iterations.append(carry.iteration if carry is not None else iteration)
    R = max(budgets + [0])
    uniforms = _response_uniforms(sampling, iterations, sample_ids, B, R, dev)
    group, source = _source_rank()
    runner = continuous.ContinuousEngine(
        model, samples, sampling, uniforms=uniforms, vocab_size=vocab_size, source=source, group=group, peers=peers,
        record_routing=record_routing, share_prefill=share_prefill, max_decode_steps=max_decode_steps,
        pipeline_groups=pipeline_groups, device=dev)
    for b, carry in enumerate(continuations):  # the old tokens keep their recorded (behaviour) log-probs
        if carry is not None and carry.log_probs is not None and runner.log_probs is not None and carry.response:
            runner.log_probs[b, :len(carry.response)] = torch.tensor(list(carry.log_probs), dtype=torch.float32,
                                                                     device=dev)
    out = runner.run()
    del runner  # the KV cache's memory returns to the allocator
    lengths = torch.tensor([s.response_length for s in samples], dtype=torch.long, device=dev)
    j = torch.arange(R, device=dev).unsqueeze(0)
    response_mask = (j < lengths.unsqueeze(1)).long()
    responses = torch.where(response_mask.bool(), out.responses, torch.full_like(out.responses, sampling.pad_id))
    log_probs = out.log_probs * response_mask if out.log_probs is not None else None
    reasons = [s.reason or "unfinished" for s in samples]
    carried_on = None
    if "unfinished" in reasons:
        carried_on = [
            Continuation(response=s.known[s.prompt_length:],
                         log_probs=log_probs[b, :s.response_length].tolist() if log_probs is not None else None,
                         iteration=iterations[b]) if reason == "unfinished" else None
            for b, (s, reason) in enumerate(zip(samples, reasons))]
    result = Rollout(
        prompts=_place_prompts(prompts, [0] * B, max(len(p) for p in prompts), sampling.pad_id, dev),
        prompt_lengths=torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev),
        responses=responses,
        response_mask=response_mask,
        response_lengths=lengths,
        ended_with_eos=torch.tensor([r == "eos" for r in reasons], dtype=torch.bool, device=dev),
        finish_reasons=reasons,
        log_probs=log_probs,
        pad_token_id=sampling.pad_id,
        seed=sampling.seed if sampling.do_sample else None,
        continuations=carried_on,
        stats=out.stats,
    )
    if out.routing is not None:
        width = max(int((result.prompt_lengths + lengths).max()), 1)
        result.routing = out.routing[:, :, :width].contiguous()
    return result


# ---------------------------------------------------------------------------------------------- input checks
def _checked_prompts(prompt_token_lists: Sequence[Sequence[int]]) -> List[List[int]]:
    """The prompts as lists of ints; raises on an empty batch or an empty prompt."""
    prompts = [[int(t) for t in p] for p in prompt_token_lists]
    if not prompts:
        raise ValueError("generate: no prompts")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: empty prompt; every prompt needs at least one token (e.g. BOS)")
    return prompts


def _use_batched_prefill(model, prefill: str) -> bool:
    """Checks that `model` can generate and resolves `prefill` ("auto" too): True for the batched prefill."""
    if isinstance(model, (list, tuple)):
        raise NotImplementedError(
            "generate: got a list of model chunks; virtual pipeline parallelism "
            "(--num-layers-per-virtual-pipeline-stage) is not supported for generation"
        )
    if prefill not in PREFILL_MODES:
        raise ValueError(f"generate: prefill={prefill!r}; choose one of {PREFILL_MODES}")
    if getattr(unwrap_model(model), "is_value_model", False):
        raise ValueError("generate: this is a value-head model (critic/reward); it has no logits")
    blocker = batched_prefill_blocker(model)
    if prefill == "batched" and blocker:
        raise ValueError(f"generate: prefill='batched' is not possible: {blocker}; use prefill='stepwise'")
    return prefill == "batched" or (prefill == "auto" and blocker is None)


def _response_uniforms(sampling: SamplingConfig, iterations: Sequence[int], sample_ids: Optional[Sequence[int]],
                       batch_size: int, max_response: int, device) -> Optional[torch.Tensor]:
    """[B, R_max] uniforms (row b's j-th response token is drawn with [b, j], from the stream of sample
    `sample_ids[b]` in RL iteration `iterations[b]`); None when greedy."""
    if not sampling.do_sample:
        return None
    if sample_ids is None:
        first = _default_dp_rank() * batch_size
        sample_ids = range(first, first + batch_size)
    if len(sample_ids) != batch_size:
        raise ValueError(f"generate: {len(sample_ids)} sample_ids for {batch_size} prompts")
    sample_ids = [int(i) for i in sample_ids]
    table = np.empty((batch_size, max(max_response, 1)), dtype=np.float64)
    for it in sorted(set(iterations)):  # one call per iteration (a continuation keeps the stream it started in)
        rows = [b for b in range(batch_size) if iterations[b] == it]
        table[rows] = sample_uniforms(sampling.seed, it, [sample_ids[b] for b in rows], table.shape[1])
    return torch.from_numpy(table).to(device)


def _place_prompts(prompts: List[List[int]], offsets: List[int], width: int, pad: int, device) -> torch.Tensor:
    """[B, width] pad tokens with row b's prompt at columns [offsets[b], offsets[b] + L_b)."""
    out = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    for b, (p, o) in enumerate(zip(prompts, offsets)):
        out[b, o: o + len(p)] = torch.tensor(p, dtype=torch.long, device=device)
    return out


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
            tokens=_place_prompts(prompts, plan.offsets, T, sampling.pad_id, dev),
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
def _expert_peers(model):
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


def _group_max(value: int, group) -> int:
    out = torch.tensor([value], dtype=torch.long, device=_device.current_device())
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return int(out.item())


def _all_finished(state: _DecodeState, peers) -> bool:
    """Every row has stopped, here and (at EP > 1) on every expert-parallel peer."""
    if peers is None:
        return state.all_finished()
    return _group_max(int(not state.all_finished()), peers) == 0


def _decode(engine: KVCacheModel, plan: KVCachePlan, state: _DecodeState, picker: _TokenPicker, peers=None,
            stats: Optional[dict] = None) -> None:
    """Prefills, then picks one slot's tokens per step and runs that slot, until every row has stopped (on every
    expert-parallel peer too, `_expert_peers`). `stats` counts the decode forwards, their rows and the rows among
    them that had already stopped."""
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
        prompts=_place_prompts(prompts, [0] * len(prompts), plan.max_prompt, pad, dev),
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


__all__ = ["generate", "batched_prefill_blocker", "continuous_engine_blockers", "PREFILL_MODES", "ENGINES"]
