"""MindSpeed-LLM's --use-fused-swiglu and --use-fused-rotary-pos-emb on megatron-core 0.16.1.

Megatron has a switch for each (`bias_activation_fusion`, `apply_rope_fusion` in its TransformerConfig), which
`models.builder` sets only when the flag is given; the kernels behind them are a `torch.compile`d CUDA fusion and
Transformer Engine's RoPE (absent here: the config refuses `apply_rope_fusion` without it). These patches put each
device's fused op in their place: torch_npu's `npu_swiglu` / `npu_rotary_position_embedding` on NPU (written from
their documented API, unverified until run on an NPU); on CPU and CUDA the SwiGLU of `kernels/fused_ops.py`, whose
backward saves less than megatron's unfused path (no torch kernel fuses it), and no RoPE: there
--use-fused-rotary-pos-emb is listed as ignored (megatron's unfused RoPE saves only cos / sin already, and torch
has no fused one). Without the flags megatron never calls these names: the default path stays megatron's unfused
one.
(--use-fused-rmsnorm is not a patch: `models.fused_ops.use_fused_norms` runs the built model's torch RMSNorms on
`device.rms_norm`.)
"""

from __future__ import annotations

import torch

from mindspeed_llm.kernels.fused_ops import lean_swiglu
from mindspeed_llm.patches import register

SWIGLU = "megatron.core.transformer.mlp.bias_swiglu_impl"
WEIGHTED_SWIGLU = "megatron.core.transformer.mlp.weighted_bias_swiglu_impl"
ROTARY = "megatron.core.models.common.embeddings.rope_utils.fused_apply_rotary_pos_emb"
TORCH_REASON = " (no torch kernel fuses it: the same math, with a backward that saves {saves})"


def _npu_swiglu(x):
    import torch_npu

    return torch_npu.npu_swiglu(x, dim=-1)


NPU_ROTARY_MAX_DIM = 896  # torch_npu's documented bound: D < 896


def _npu_rotary(t, cos, sin, interleaved):
    """`t` SBND (`[s, b, heads, d]`), cos / sin `[s, 1 or b, 1, d]`: torch_npu's op in its documented layouts (mode 0
    takes S11D and SB1D tables, mode 1 only S11D; D < 896), megatron's own math otherwise (the per-row tables of
    packed positions in mode 1, wide heads)."""
    if t.size(-1) >= NPU_ROTARY_MAX_DIM or (interleaved and cos.size(1) != 1):
        from megatron.core.models.common.embeddings.rope_utils import _rotate_half

        return (t * cos) + (_rotate_half(t, interleaved) * sin)
    import torch_npu

    return torch_npu.npu_rotary_position_embedding(t.contiguous(), cos, sin, 1 if interleaved else 0)


def _swiglu_impl(swiglu):
    def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
        if fp8_input_store:
            raise ValueError("--use-fused-swiglu: megatron's fp8 activation storage is not supported here")
        return swiglu(input if bias is None else input + bias)

    return bias_swiglu_impl


def _weighted_swiglu_impl(swiglu):
    def weighted_bias_swiglu_impl(input, bias, weights, fp8_input_store=False):
        if bias is not None or fp8_input_store:
            raise ValueError("--use-fused-swiglu: a biased or fp8-stored weighted SwiGLU is not supported here")
        # megatron's unfused path: glu(x) * per_token_scale, back to the activation's dtype
        return (swiglu(input) * weights).to(input.dtype)

    return weighted_bias_swiglu_impl


def _rotary_impl(rotary):
    def fused_apply_rotary_pos_emb(t, freqs, transpose_output_memory=False, interleaved=False):
        # megatron's unfused _apply_rotary_pos_emb_bshd at mscale 1 (megatron itself goes unfused otherwise)
        rot_dim = freqs.shape[-1]
        rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
        cos_, sin_ = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
        out = rotary(rotated, cos_, sin_, interleaved)
        return out if passed.size(-1) == 0 else torch.cat((out, passed), dim=-1)

    return fused_apply_rotary_pos_emb


_SWIGLU_REASON = ("--use-fused-swiglu (megatron's bias_activation_fusion): {op} in place of megatron's "
                  "torch.compile'd fusion")
_WEIGHTED_REASON = ("--use-fused-swiglu in MoE experts that weight tokens by their routing probabilities (megatron's "
                    "bias_activation_fusion with per_token_scale): {op}, then the weights")
_ROTARY_REASON = "--use-fused-rotary-pos-emb (megatron's apply_rope_fusion): {op} in place of Transformer Engine's"

register(SWIGLU, _SWIGLU_REASON.format(op="torch_npu.npu_swiglu"), devices=("npu",))(
    lambda _original: _swiglu_impl(_npu_swiglu))
register(SWIGLU, _SWIGLU_REASON.format(op="a plain-torch SwiGLU") + TORCH_REASON.format(saves="its input only"),
         devices=("cpu", "cuda"))(lambda _original: _swiglu_impl(lean_swiglu))
register(WEIGHTED_SWIGLU, _WEIGHTED_REASON.format(op="torch_npu.npu_swiglu"), devices=("npu",))(
    lambda _original: _weighted_swiglu_impl(_npu_swiglu))
register(WEIGHTED_SWIGLU, _WEIGHTED_REASON.format(op="a plain-torch SwiGLU"), devices=("cpu", "cuda"))(
    lambda _original: _weighted_swiglu_impl(lean_swiglu))
register(ROTARY, _ROTARY_REASON.format(op="torch_npu.npu_rotary_position_embedding"), devices=("npu",))(
    lambda _original: _rotary_impl(_npu_rotary))
