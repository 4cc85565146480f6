"""Decode steps at a fixed shape, and their capture as one CUDA graph per `generate` call (CUDA only).

Megatron-core 0.16.1's static KV cache is indexed with a Python int at every decode step (the slot written,
the keys read ``[:sequence_end]``, the rotary rows of that slot), so every step launches different kernels
with different shapes and a CUDA graph of one step is valid for that step only. Megatron's own graphed decode
needs ``flash_decode`` (flash-attn's ``flash_attn_with_kvcache``), which this project does not use (its batched
prefill needs attention that honours explicit masks; see ``mindspeed_llm.inference.static_engine``).

:class:`StaticDecodeKVCacheModel` (a subclass of ``kv_cache.KVCacheModel``) makes every decode step the
same computation on the same buffers, with the slot as a *tensor*:

* inputs: the step's tokens and positions are copied into fixed ``[B, 1]`` buffers, the slot into a ``[1]``
  long tensor;
* each attention layer (``Attention._adjust_key_value_for_inference``, wrapped once per process by
  ``mindspeed_llm/patches/static_decode.py``; the wrapper acts only for the inference context of such an engine
  and passes every other call through):
  rotates the new key with the rotary row of the slot (``index_select``) and writes key and value into the
  cache with ``index_copy_`` at the slot, then attends over ALL ``T`` slots of the cache; the query gets its
  rotary row the same way;
* the attention mask hides the left padding and every slot after the current one
  (``key_is_pad | arange(T) > slot``). Megatron's masked softmax fills them with -10000 before the softmax, so
  their weight underflows to exactly zero, and
  the slots after the prefill are zeroed once (``torch.empty`` memory may hold NaN, and 0 * NaN is NaN).

The prefill (Python-int slots, a forward per call) goes through the same wrapper and caches keys *after*
rotary, so the whole cache is consistently post-rotary (``mindspeed_llm/patches/inference.py`` does the same
for the ordinary static step on every device; unpatched megatron caches keys before rotary and re-rotates them
all at every step, which the fixed-shape step does not do). The logits equal the ordinary path's up to the
summation order over the extra zero-weight slots; greedy tokens are the same (tests/dist/test_cuda_graph.py).

With ``graph=True`` (CUDA only) the first decode step is run once eagerly on a side stream (warm-up: lazy
buffers, NCCL communicators) and then captured; every step (the first included) replays the graph after
copying its inputs. One capture per `generate` call, because the KV cache is allocated per call. The graph is
freed by ``release()``. Not supported (the engine then runs the ordinary step, and says why in
``static_reason``): pipeline parallelism (p2p send/recv between stages per step), recording MoE routing (the
hooks collect per-forward Python lists), ``flash_decode``; and for the graph, MoE layers (the token
dispatchers read split sizes on the host).

Switch: ``MINDSPEED_DECODE_CUDA_GRAPH=1`` (see :func:`decode_cuda_graph_requested`); off by default and never
on for a non-CUDA device. ``generation.generate``'s static engine (``static_engine.py``) runs the
``EngineOptions.static_kv_cache_model`` it is given, by default the class :func:`engine_class` picks for the device
(this module imports ``kv_cache``, never ``generation`` or ``static_engine``), and ``engine="auto"`` picks the static
engine while the switch is on (the continuous-batching engine, ``inference/continuous.py``, has no graphed step).
Tests and benchmarks pass the engine class itself: ``generate(..., options=EngineOptions(static_kv_cache_model=
functools.partial(StaticDecodeKVCacheModel, graph=True)))``.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron.core.utils import get_model_config

from mindspeed_llm.inference.kv_cache import KVCacheModel
from mindspeed_llm.models import routing
from mindspeed_llm.patches.static_decode import STATIC_ATTR as _STATIC_ATTR
from mindspeed_llm.patches.static_decode import StaticState as _StaticState
from mindspeed_llm.patches.static_decode import install_attention_wrapper as _install_attention_wrapper
from mindspeed_llm.patches.static_decode import no_rng_fork as _no_rng_fork

__all__ = ["StaticDecodeKVCacheModel", "decode_cuda_graph_requested", "engine_class", "DECODE_CUDA_GRAPH_ENV"]

DECODE_CUDA_GRAPH_ENV = "MINDSPEED_DECODE_CUDA_GRAPH"


def decode_cuda_graph_requested(device) -> bool:
    """Whether the decode step should be captured as a CUDA graph: ``MINDSPEED_DECODE_CUDA_GRAPH`` is 1 (0 or
    unset: no) and ``device`` is a CUDA device. Any other value is an error naming the variable."""
    value = os.environ.get(DECODE_CUDA_GRAPH_ENV, "0").strip().lower()
    if value not in ("0", "1", "", "false", "true", "off", "on"):
        raise ValueError(f"{DECODE_CUDA_GRAPH_ENV}={value!r}: use 1 (capture the decode step on CUDA) or 0")
    return value in ("1", "true", "on") and getattr(device, "type", str(device)) == "cuda"


def engine_class(device):
    """The KV-cache model class `generate`'s static engine runs on `device` by default: ``KVCacheModel`` unless
    the switch is on."""
    if decode_cuda_graph_requested(device):
        return _GraphedEngine
    return KVCacheModel


class StaticDecodeKVCacheModel(KVCacheModel):
    """``KVCacheModel`` with fixed-shape decode steps (module docstring); ``graph=True`` captures
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
        if getattr(get_model_config(self.model), "flash_decode", False):
            return "flash_decode=True (megatron's own decode kernel)"
        if self.graph and routing.moe_routers(self.model):
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
        the next step overwrites: read them before the next call (the static engine's loop does)."""
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

