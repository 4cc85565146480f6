"""Decode steps at a fixed shape, and their capture as one CUDA graph per `generate` call (CUDA only).

Megatron-core 0.16.1's static KV cache is indexed with a Python int at every decode step (the slot written,
the keys read ``[:sequence_end]``, the rotary rows of that slot), so every step launches different kernels
with different shapes and a CUDA graph of one step is valid for that step only. Megatron's own graphed decode
needs ``flash_decode`` (flash-attn's ``flash_attn_with_kvcache``), which this project does not use (its batched
prefill needs attention that honours explicit masks; see ``mindspeed_llm.inference.generation``).

:class:`StaticDecodeKVCacheModel` (a drop-in for generation's ``_KVCacheModel``) makes every decode step the
same computation on the same buffers, with the slot as a *tensor*:

* inputs: the step's tokens and positions are copied into fixed ``[B, 1]`` buffers, the slot into a ``[1]``
  long tensor;
* each attention layer (``Attention._adjust_key_value_for_inference``, wrapped once per process; the wrapper acts
  only for the inference context of such an engine and passes every other call through):
  rotates the new key with the rotary row of the slot (``index_select``) and writes key and value into the
  cache with ``index_copy_`` at the slot, then attends over ALL ``T`` slots of the cache; the query gets its
  rotary row the same way;
* the attention mask hides the left padding and every slot after the current one
  (``key_is_pad | arange(T) > slot``). Megatron's masked softmax fills them with -10000 before the softmax, so
  their weight underflows to exactly zero, and
  the slots after the prefill are zeroed once (``torch.empty`` memory may hold NaN, and 0 * NaN is NaN).

The prefill (Python-int slots, a forward per call) goes through the same wrapper and caches keys *after*
rotary, so the whole cache is consistently post-rotary (on CPU ``mindspeed_llm/patches/inference.py`` does
the same; on CUDA megatron caches keys before rotary and re-rotates them all at every step, which the
fixed-shape step does not do). The logits equal the ordinary path's up to the summation order over the
extra zero-weight slots; greedy tokens are the same (tests/test_cuda_graph.py).

With ``graph=True`` (CUDA only) the first decode step is run once eagerly on a side stream (warm-up: lazy
buffers, NCCL communicators) and then captured; every step (the first included) replays the graph after
copying its inputs. One capture per `generate` call, because the KV cache is allocated per call. The graph is
freed by ``release()``. Not supported (the engine then runs the ordinary step, and says why in
``static_reason``): pipeline parallelism (p2p send/recv between stages per step), recording MoE routing (the
hooks collect per-forward Python lists), ``flash_decode``; and for the graph, MoE layers (the token
dispatchers read split sizes on the host).

Switch: ``MINDSPEED_DECODE_CUDA_GRAPH=1`` (see :func:`decode_cuda_graph_requested`); off by default and never
on for a non-CUDA device. Hook in ``generation.generate`` (not wired here: generation.py has another owner),
in place of ``engine = _KVCacheModel(model, plan, record_routing)`` (a local import: this module imports
generation)::

    from mindspeed_llm.inference import cuda_graph
    engine = cuda_graph.engine_class(dev)(model, plan, record_routing)  # _KVCacheModel unless switched on
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from mindspeed_llm.inference import generation

__all__ = ["StaticDecodeKVCacheModel", "decode_cuda_graph_requested", "engine_class", "static_decode_engine",
           "DECODE_CUDA_GRAPH_ENV"]

DECODE_CUDA_GRAPH_ENV = "MINDSPEED_DECODE_CUDA_GRAPH"
_STATIC_ATTR = "_mindspeed_static_decode"  # set on a StaticInferenceContext: this engine's wrapper applies


def decode_cuda_graph_requested(device) -> bool:
    """Whether the decode step should be captured as a CUDA graph: ``MINDSPEED_DECODE_CUDA_GRAPH`` is 1 (0 or
    unset: no) and ``device`` is a CUDA device. Any other value is an error naming the variable."""
    value = os.environ.get(DECODE_CUDA_GRAPH_ENV, "0").strip().lower()
    if value not in ("0", "1", "", "false", "true", "off", "on"):
        raise ValueError(f"{DECODE_CUDA_GRAPH_ENV}={value!r}: use 1 (capture the decode step on CUDA) or 0")
    return value in ("1", "true", "on") and getattr(device, "type", str(device)) == "cuda"


def engine_class(device):
    """The engine class `generate` should use on `device` (generation's own unless the switch is on)."""
    if decode_cuda_graph_requested(device):
        return _GraphedEngine
    return generation._KVCacheModel


class _StaticState:
    """What the wrapped attention reads from the inference context while a static engine runs."""

    def __init__(self):
        self.slot: Optional[torch.Tensor] = None  # [1] long: the decode step's slot; None: prefill (int slots)


def _install_attention_wrapper():
    """Wraps ``Attention._adjust_key_value_for_inference`` once per process; the wrapper acts only for a
    context that carries ``_mindspeed_static_decode`` (set by the static engine, removed by its release), so
    every other caller, and training, gets the previous function unchanged."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.transformer import attention as attention_module
    from megatron.core.transformer.enums import AttnMaskType

    Attention = attention_module.Attention
    previous = Attention._adjust_key_value_for_inference
    if getattr(previous, "_mindspeed_static_decode", False):
        return
    mscale_of = attention_module._yarn_get_concentration_factor_from_config

    def _adjust_key_value_for_inference(self, inference_context, query, key, value, rotary_pos_emb=None,
                                        *args, **kwargs):
        state = getattr(inference_context, _STATIC_ATTR, None) if inference_context is not None else None
        if state is None or self.training or kwargs.get("inference_params") is not None:
            return previous(self, inference_context, query, key, value, rotary_pos_emb, *args, **kwargs)
        if self.layer_number not in inference_context.key_value_memory_dict:  # first call: allocate as megatron
            inference_context.key_value_memory_dict[self.layer_number] = tuple(
                self._allocate_memory(inference_context.max_sequence_length, inference_context.max_batch_size,
                                      size, t.dtype)
                for size, t in ((self.key_hidden_size, key), (self.val_hidden_size, value)))
        key_memory, value_memory = inference_context.key_value_memory_dict[self.layer_number]
        b0 = inference_context.batch_size_offset
        b1 = b0 + key.size(1)
        q_emb = k_emb = None
        if rotary_pos_emb is not None:
            q_pos_emb, k_pos_emb = rotary_pos_emb
        if state.slot is None:  # prefill: int slots, like megatron, but keys cached after rotary
            start = inference_context.sequence_len_offset
            end = start + key.size(0)
            if rotary_pos_emb is not None:
                q_emb, k_emb = q_pos_emb[start:end], k_pos_emb[start:end]
            index = slice(start, end)
            keys_until = end
        else:  # fixed-shape decode step: the slot is a tensor, every slot is read (the mask hides the future)
            if rotary_pos_emb is not None:
                q_emb, k_emb = q_pos_emb.index_select(0, state.slot), k_pos_emb.index_select(0, state.slot)
            index = None
            keys_until = key_memory.size(0)
        if k_emb is not None:
            key = apply_rotary_pos_emb(key, k_emb, config=self.config, mscale=mscale_of(self.config),
                                       cp_group=self.pg_collection.cp)
        if index is None:
            key_memory[:, b0:b1].index_copy_(0, state.slot, key)
            value_memory[:, b0:b1].index_copy_(0, state.slot, value)
            mask_type = AttnMaskType.no_mask  # the explicit mask carries padding and future slots
        else:
            key_memory[index, b0:b1] = key
            value_memory[index, b0:b1] = value
            mask_type = self.attn_mask_type if inference_context.sequence_len_offset == 0 else AttnMaskType.no_mask
        rotary = (q_emb, None) if q_emb is not None else None  # key already rotated: Attention.forward skips None
        return (query, key_memory[:keys_until, b0:b1], value_memory[:keys_until, b0:b1], rotary, mask_type, None)

    _adjust_key_value_for_inference.__wrapped__ = previous
    _adjust_key_value_for_inference._mindspeed_static_decode = True
    Attention._adjust_key_value_for_inference = _adjust_key_value_for_inference


@contextlib.contextmanager
def _no_rng_fork():
    """Megatron's core attention forks the tensor-parallel CUDA RNG state (get/set of the generator state, host
    side) around its dropout even in eval mode, where the dropout is the identity and draws nothing; that state
    juggling has no place in a graph capture, so the fork is a no-op while capturing."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    had = "fork" in vars(tracker)
    original = tracker.fork
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        if had:
            tracker.fork = original
        else:
            del tracker.fork


class StaticDecodeKVCacheModel(generation._KVCacheModel):
    """generation's ``_KVCacheModel`` with fixed-shape decode steps (module docstring); ``graph=True`` captures
    the step as a CUDA graph. Where the fixed-shape step is not supported it behaves exactly like the base
    class (``static_reason`` says why)."""

    graph_default = False

    def __init__(self, model, plan, record_routing: bool = False, graph: Optional[bool] = None):
        super().__init__(model, plan, record_routing)
        self.graph = self.graph_default if graph is None else bool(graph)
        self.static_reason = self._unsupported()
        if self.graph and self.static_reason is None and plan.starts.device.type != "cuda":
            raise ValueError(f"decode CUDA graph requested for a model on {plan.starts.device}: CUDA only "
                             f"(unset {DECODE_CUDA_GRAPH_ENV})")
        self.static_steps = 0  # decode steps run through the fixed-shape path (tests check it is used)
        self._buffers = None
        self._graph = self._graph_logits = None
        if self.static_reason is None:
            _install_attention_wrapper()
            setattr(self.context, _STATIC_ATTR, _StaticState())

    def _unsupported(self) -> Optional[str]:
        if self.wrapper.pp_group.size() > 1:
            return "pipeline parallelism (stages exchange activations by p2p at every step)"
        if self.capture is not None:
            return "MoE routing is being recorded (Python-side hooks per forward)"
        if getattr(generation.get_model_config(self.model), "flash_decode", False):
            return "flash_decode=True (megatron's own decode kernel)"
        if self.graph and generation.routing.moe_routers(self.model):
            return "CUDA graph of a model with MoE layers (the token dispatchers read split sizes on the host)"
        return None

    def release(self) -> None:
        self._graph = self._graph_logits = self._buffers = None
        if hasattr(self.context, _STATIC_ATTR):
            delattr(self.context, _STATIC_ATTR)
        super().release()

    def _start_static(self, pos: int) -> None:
        """Fixed buffers; the cache slots from `pos` on are zeroed (they are read, with zero weight, from now on)."""
        plan = self.plan
        B, T, dev = len(plan.offsets), plan.slots, plan.starts.device
        for buffers in self.context.key_value_memory_dict.values():
            for buf in buffers:
                if buf is not None:
                    buf[pos:].zero_()
        key_is_pad = plan.key_is_pad if plan.batched else torch.zeros((B, 1, 1, T), dtype=torch.bool, device=dev)
        self._buffers = dict(
            tokens=torch.zeros((B, 1), dtype=torch.long, device=dev),
            positions=torch.zeros((B, 1), dtype=torch.long, device=dev),
            slot=torch.zeros(1, dtype=torch.long, device=dev),
            slots=torch.arange(T, device=dev).view(1, 1, 1, T),
            key_is_pad=key_is_pad,
        )
        getattr(self.context, _STATIC_ATTR).slot = self._buffers["slot"]

    def _static_forward(self) -> torch.Tensor:
        """One decode step on the fixed buffers (what the CUDA graph records)."""
        b = self._buffers
        mask = b["key_is_pad"] | (b["slots"] > b["slot"].view(1, 1, 1, 1))
        logits = self.wrapper._forward({"tokens": b["tokens"], "position_ids": b["positions"], "attention_mask": mask})
        return logits[:, -1, :]

    def _capture(self) -> None:
        with _no_rng_fork():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: allocates lazy buffers, sets up communicators
                self._static_forward()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._graph_logits = self._static_forward()
        self._graph = graph

    def decode_step(self, tokens: torch.Tensor, pos: int) -> Optional[torch.Tensor]:
        """Logits of slot `pos` (as the base class). With a graph they live in the graph's output buffer, which
        the next step overwrites: read them before the next call (generation's loop does)."""
        if self.static_reason is not None:
            return super().decode_step(tokens, pos)
        if pos >= self.plan.max_prompt:
            self.context.enable_decode_mode()
        if self._buffers is None:
            self._start_static(pos)
        b = self._buffers
        b["tokens"].copy_(tokens[:, pos:pos + 1])
        b["positions"].copy_(self.plan.position_ids[:, pos:pos + 1])
        b["slot"].fill_(pos)
        if self.graph:
            if self._graph is None:
                self._capture()
            self._graph.replay()
            logits = self._graph_logits
        else:
            logits = self._static_forward()
        self.context.sequence_len_offset = pos + 1  # megatron's bookkeeping, as the wrapper would advance it
        self.static_steps += 1
        return logits


class _GraphedEngine(StaticDecodeKVCacheModel):
    graph_default = True


@contextlib.contextmanager
def static_decode_engine(graph: bool = False, engines: Optional[list] = None, engine_cls=None):
    """Makes `generation.generate` use :class:`StaticDecodeKVCacheModel` (or `engine_cls`; ``graph``: capture on
    CUDA) inside the block, collecting the engines it creates into `engines` (tests read ``static_steps`` /
    ``static_reason``). For tests and benchmarks; the run's switch is the hook in `generate` (module docstring)."""
    original = generation._KVCacheModel
    engine_cls = engine_cls or StaticDecodeKVCacheModel

    def make(model, plan, record_routing=False):
        engine = engine_cls(model, plan, record_routing, graph=graph)
        if engines is not None:
            engines.append(engine)
        return engine

    generation._KVCacheModel = make
    try:
        yield engines
    finally:
        generation._KVCacheModel = original
