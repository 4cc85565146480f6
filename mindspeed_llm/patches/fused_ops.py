"""MindSpeed-LLM's --use-fused-swiglu and --use-fused-rotary-pos-emb on megatron-core 0.16.1 (all devices).

Megatron has a switch for each (`bias_activation_fusion`, `apply_rope_fusion` in its TransformerConfig), which
`models.builder` sets only when the flag is given; its kernels behind them are a `torch.compile`d CUDA fusion and
Transformer Engine's RoPE (absent here: the config refuses `apply_rope_fusion` without it). These patches put the
device layer's fused ops (`mindspeed_llm.device.swiglu` / `rotary_embedding`: torch_npu's `npu_swiglu` /
`npu_rotary_position_embedding` on NPU, a plain-torch autograd function that saves less on CPU and CUDA) in their
place. Without the flags megatron never calls these names: the default path is megatron's unfused one, unchanged.
(--use-fused-rmsnorm is not a patch: `models.fused_ops.use_fused_norms` runs the built model's torch RMSNorms on the
device's fused norm.)
"""

from __future__ import annotations

import torch

from mindspeed_llm.patches import register

ALL_DEVICES = ("cpu", "cuda", "npu")


@register(
    "megatron.core.transformer.mlp.bias_swiglu_impl",
    "--use-fused-swiglu (megatron's bias_activation_fusion): the device's fused SwiGLU (npu_swiglu on NPU, a "
    "backward that saves the input only elsewhere) in place of megatron's torch.compile'd CUDA fusion",
    devices=ALL_DEVICES,
)
def _fused_swiglu(_original):
    from mindspeed_llm import device

    def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
        if fp8_input_store:
            raise ValueError("--use-fused-swiglu: fp8 activation storage is not supported here")
        return device.swiglu(input if bias is None else input + bias)

    return bias_swiglu_impl


@register(
    "megatron.core.transformer.mlp.weighted_bias_swiglu_impl",
    "--use-fused-swiglu in MoE experts that weight tokens by their routing probabilities (megatron's "
    "bias_activation_fusion with per_token_scale): the device's fused SwiGLU, then the weights",
    devices=ALL_DEVICES,
)
def _fused_weighted_swiglu(_original):
    from mindspeed_llm import device

    def weighted_bias_swiglu_impl(input, bias, weights, fp8_input_store=False):
        if bias is not None or fp8_input_store:
            raise ValueError("--use-fused-swiglu: a biased or fp8-stored weighted SwiGLU is not supported here")
        # megatron's unfused path: glu(x) * per_token_scale, back to the activation's dtype
        return (device.swiglu(input) * weights).to(input.dtype)

    return weighted_bias_swiglu_impl


@register(
    "megatron.core.models.common.embeddings.rope_utils.fused_apply_rotary_pos_emb",
    "--use-fused-rotary-pos-emb (megatron's apply_rope_fusion): the device's fused RoPE (npu_rotary_position_"
    "embedding on NPU, a backward that saves cos / sin instead of the query / key elsewhere) in place of Transformer "
    "Engine's",
    devices=ALL_DEVICES,
)
def _fused_rotary(_original):
    from mindspeed_llm import device

    def fused_apply_rotary_pos_emb(t, freqs, transpose_output_memory=False, interleaved=False):
        # as megatron's unfused _apply_rotary_pos_emb_bshd (mscale 1: megatron itself goes unfused otherwise)
        rot_dim = freqs.shape[-1]
        rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
        cos_, sin_ = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
        out = device.rotary_embedding(rotated, cos_, sin_, interleaved)
        return out if passed.size(-1) == 0 else torch.cat((out, passed), dim=-1)

    return fused_apply_rotary_pos_emb
