"""Rollout generation: `generate`, which checks its inputs and runs one of two engines.

* `engine="continuous"` (the default where it can run, `engine="auto"`): `inference/continuous.py`, continuous
  batching over its own bounded KV cache (`SamplingConfig.max_num_seqs` rows in flight, a finished row's slot takes
  the next sample, pipeline stages busy with micro-batch groups, partial rollouts via `max_decode_steps` /
  `continuations`). Its tokens equal the static engine's.
* `engine="static"`: `inference/static_engine.py`, megatron's `GPTInferenceWrapper` + `StaticInferenceContext`, the
  whole batch in lock-step; the reference, the stepwise prefill and the CUDA-graph decode step (`cuda_graph.py`); its
  KV cache and slot plan are `kv_cache.py`'s. Its module docstring describes the batched and stepwise prefills.

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
`_generate_continuous`, the static one in `static_engine.generate_static`. What both take from the batch and the
parallel state (the token-picking rank, the expert-parallel peers, each row's uniforms) is `engine_inputs.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
from megatron.core.transformer.enums import AttnBackend
from megatron.core.utils import get_model_config, unwrap_model

from mindspeed_llm import device as _device
from mindspeed_llm.inference import continuous, cuda_graph
from mindspeed_llm.inference.continuous_plan import Sample
from mindspeed_llm.inference.engine_inputs import expert_peers, place_prompts, response_uniforms, source_rank
from mindspeed_llm.inference.kv_cache import KVCacheModel
from mindspeed_llm.inference.results import Continuation, Rollout, observation_mask
from mindspeed_llm.inference.sampling import SamplingConfig
from mindspeed_llm.inference.static_engine import generate_static
from mindspeed_llm.inference.turns import TurnExchange, TurnHandler
from mindspeed_llm.models import explicit_groups
from mindspeed_llm.models.attention import model_attention
from mindspeed_llm.models.sequence_parallel import sequence_parallel_off

PREFILL_MODES = ("auto", "batched", "stepwise")


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


@dataclass(frozen=True)
class EngineOptions:
    """How the engines run a batch, not what they generate: the tokens and log-probs are the same with any of these
    (tests and benchmarks compare them).

    share_prefill: rows whose prefill window repeats (GRPO's n samples of a prompt) are prefilled once and copied;
        False prefills every row.
    pipeline_groups: the continuous engine's number of row groups (default: the pipeline size; 1: the whole batch
        passes the stages in turn).
    static_kv_cache_model: the static engine's KV-cache model, called as
        `static_kv_cache_model(model, plan, record_routing)` with the batch's `KVCachePlan` (`inference/kv_cache.py`);
        default: what `cuda_graph.engine_class` picks for the device (`KVCacheModel`, or the fixed-shape CUDA-graph
        step where MINDSPEED_DECODE_CUDA_GRAPH=1 on CUDA). Tests and benchmarks pass
        `cuda_graph.StaticDecodeKVCacheModel` (or a subclass). Given, it selects the static engine under
        `engine="auto"` (`engine="continuous"` refuses it).
    parked_kv: multi-turn (`generate(turns=...)`): "keep": a sample waiting for a tool keeps its slot and KV, and only
        the tool's tokens are prefilled when they arrive; "free": its slot is freed at once (another sample takes it)
        and its whole prefix is prefilled on resumption; "auto" (default): kept until a pending sample needs the slot.
        Same tokens in every mode (`continuous_plan`).
    """

    share_prefill: bool = True
    pipeline_groups: Optional[int] = None
    static_kv_cache_model: Optional[Callable[..., KVCacheModel]] = None
    parked_kv: str = "auto"  # multi-turn: a parked sample's slot and KV: "auto" | "keep" | "free"


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
    options: Optional[EngineOptions] = None,
    turns: Optional[TurnHandler] = None,
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
        options: `EngineOptions`, how the engines run (the shared prefill of repeated prompts, the continuous engine's
            row groups, the static engine's KV-cache model); the defaults serve every run.
        turns: continuous engine: a `turns.TurnHandler` that answers a model turn with an observation (a tool's
            output as token ids) to continue from; the response then holds the turns and the observations
            (`Rollout.tool_mask` marks the latter), within `response_budgets` (all of a trajectory's tokens), each
            model turn within the handler's `turn_token_limit`.
    """
    sampling = sampling or SamplingConfig()
    options = options or EngineOptions()
    prompts = _checked_prompts(prompt_token_lists)
    batched = _use_batched_prefill(model, prefill)
    dev = _device.current_device()
    budgets = _budgets(sampling, prompts, response_budgets)
    peers = expert_peers(model)
    chosen = _choose_engine(model, engine, prefill, batched, sampling, dev, peers,
                            {"max_decode_steps": max_decode_steps, "continuations": continuations,
                             "options.pipeline_groups": options.pipeline_groups, "turns": turns},
                            options.static_kv_cache_model is not None)
    if chosen == "continuous":
        # --sequence-parallel: as in the static engine, the plain tensor-parallel model (models/sequence_parallel.py)
        with sequence_parallel_off(model):
            return _generate_continuous(model, prompts, budgets, sampling, iteration, sample_ids, vocab_size,
                                        record_routing, max_decode_steps, continuations, options, peers, dev,
                                        turns)
    return generate_static(model, prompts, budgets, sampling, iteration, sample_ids, vocab_size, record_routing,
                           batched, options.share_prefill, options.static_kv_cache_model, peers, dev)


def _choose_engine(model, engine: str, prefill: str, batched: bool, sampling: SamplingConfig, device, peers,
                   continuous_only: dict, static_kv_cache_model_given: bool = False) -> str:
    """"continuous" or "static" for `engine` (see `generate`); raises where the choice cannot be honoured."""
    if engine not in ENGINES:
        raise ValueError(f"generate: engine={engine!r}; choose one of {ENGINES}")
    wanted = [name for name, value in continuous_only.items() if value is not None]
    wanted += [f"sampling.{name}" for name in ("max_num_seqs", "max_num_batched_tokens")
               if getattr(sampling, name) is not None]
    blockers = _continuous_blockers(model, prefill, batched, device, peers)
    if static_kv_cache_model_given:
        blockers.append("options.static_kv_cache_model is given (the static engine's KV-cache model)")
    if explicit_groups(model) is not None and (engine == "static" or (engine == "auto" and blockers)):
        why = "engine='static'" if engine == "static" else "; ".join(blockers)
        raise ValueError(f"generate: a model built on explicit groups (a generator rank) runs the continuous engine "
                         f"only (the static one reads megatron's parallel_state), but {why}")
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
                                expert_peers(model))


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
                         max_decode_steps, continuations, options, peers, dev, turns) -> Rollout:
    """`generate` on `inference/continuous.py`'s engine."""
    B = len(prompts)
    pipeline_groups = options.pipeline_groups
    if turns is not None and max_decode_steps is not None:
        raise ValueError("generate: turns (multi-turn) with max_decode_steps is not supported; give per-sample "
                         "response_budgets (a sample that reaches its budget before its trajectory's is continued)")
    if max_decode_steps is not None and (isinstance(max_decode_steps, bool) or int(max_decode_steps) < 1):
        raise ValueError(f"generate: max_decode_steps={max_decode_steps!r} must be an integer >= 1")
    if pipeline_groups is not None and int(pipeline_groups) < 1:
        raise ValueError(f"generate: options.pipeline_groups={pipeline_groups!r} must be >= 1")
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
        sample = Sample(prompt + carried, len(prompt), budget)
        if carry is not None:
            sample.observed, sample.turn_start = [tuple(span) for span in carry.observed], int(carry.turn_start)
        whole = turns.trajectory_budget(b) if turns is not None else None
        if whole is not None:
            sample.total_budget = int(whole)
        if sample.response_length >= sample.whole_budget:
            sample.reason = "length"
        elif sample.response_length >= budget:
            sample.cut = True
        samples.append(sample)
        iterations.append(carry.iteration if carry is not None else iteration)
    R = max([s.whole_budget for s in samples] + [0])  # a trajectory may pass this call's budget with a tool answer
    uniforms = response_uniforms(sampling, iterations, sample_ids, B, R, dev, groups=explicit_groups(model))
    group, source = source_rank(model)
    runner = continuous.ContinuousEngine(
        model, samples, sampling, uniforms=uniforms, vocab_size=vocab_size, source=source, group=group, peers=peers,
        record_routing=record_routing, share_prefill=options.share_prefill, max_decode_steps=max_decode_steps,
        pipeline_groups=pipeline_groups, device=dev,
        turns=TurnExchange(turns, source, group, dev) if turns is not None else None,
        parked_kv=options.parked_kv)
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
                         iteration=iterations[b], observed=tuple(s.observed))
            if reason == "unfinished" else None
            for b, (s, reason) in enumerate(zip(samples, reasons))]
    result = Rollout(
        prompts=place_prompts(prompts, [0] * B, max(len(p) for p in prompts), sampling.pad_id, dev),
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
        tool_mask=observation_mask([s.observed for s in samples], R).to(dev) if turns is not None else None,
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


__all__ = ["generate", "EngineOptions", "batched_prefill_blocker", "continuous_engine_blockers", "PREFILL_MODES",
           "ENGINES"]
