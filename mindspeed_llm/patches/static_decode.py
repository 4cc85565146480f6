"""On-demand patches for the fixed-shape (CUDA-graph) decode step of `mindspeed_llm/inference/cuda_graph.py`.

Not in the setup-time registry: they are installed only when that engine runs (``MINDSPEED_DECODE_CUDA_GRAPH=1``
on CUDA), and they act only on an inference context marked with ``STATIC_ATTR``; every other caller, training
included, reaches the previous function unchanged. They live here so that megatron is patched in one package.

- ``Attention._adjust_key_value_for_inference``: a decode slot given as a tensor (rotary row and KV write by
  index, the whole cache returned, the explicit mask hides padding and future slots); keys cached after rotary.
- the tensor-parallel RNG tracker's ``fork`` is a no-op during a capture (eval-mode dropout draws nothing).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

STATIC_ATTR = "_mindspeed_static_decode"  # set on a StaticInferenceContext: the wrapper applies to it


class StaticState:
    """What the wrapped attention reads from the inference context while a static engine runs."""

    def __init__(self):
        self.slot: Optional[torch.Tensor] = None  # [1] long: the decode step's slot; None: prefill (int slots)


def install_attention_wrapper():
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
        state = getattr(inference_context, STATIC_ATTR, None) if inference_context is not None else None
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
def no_rng_fork():
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
