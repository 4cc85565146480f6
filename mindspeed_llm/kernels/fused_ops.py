"""Plain-torch RMSNorm and SwiGLU with hand-written backwards that save what fused kernels save: the ops of
MindSpeed-LLM's --use-fused-rmsnorm (CPU) and --use-fused-swiglu (CPU, CUDA) off the NPU (`device.FUSED_OPS`).
The forward is torch's / megatron's composite math (the same values); the backward recomputes what the composite
path kept (tests/unit/test_fused_ops.py checks values and gradients against it). No RoPE here: megatron's unfused
RoPE already saves only cos / sin (`t * cos` keeps `cos`, not `t`)."""

from __future__ import annotations

import torch


def lean_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's RMSNorm over the last dimension (`_LeanRMSNorm`)."""
    return _LeanRMSNorm.apply(x, weight, eps)


def lean_swiglu(x: torch.Tensor) -> torch.Tensor:
    """megatron's SwiGLU of the last dimension's halves (`_LeanSwiGLU`)."""
    return _LeanSwiGLU.apply(x)


class _LeanRMSNorm(torch.autograd.Function):
    """torch's composite RMSNorm (float32 math, the weight included, cast to `x`'s dtype at the end), saving `x` and
    the float32 rstd per row instead of float32 copies of `x` and of the normalised value."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x32 * rstd * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        grad32 = grad.float()
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad32 * normed).reshape(-1, x.size(-1)).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = grad32 * weight.float()
            grad_x = (rstd * (g - normed * (g * normed).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_weight, None


class _LeanSwiGLU(torch.autograd.Function):
    """megatron's `silu(x[0]) * x[1]` (`torch.chunk(x, 2, -1)`), saving `x` only (the unfused path also keeps the
    activation `silu(x[0])`, half of `x` again); the backward computes in float32."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        gate, up = torch.chunk(x, 2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        gate, up = (part.float() for part in torch.chunk(x, 2, dim=-1))
        sig = torch.sigmoid(gate)
        grad32 = grad.float()
        grad_gate = grad32 * up * sig * (1.0 + gate * (1.0 - sig))
        grad_up = grad32 * gate * sig
        return torch.cat((grad_gate, grad_up), dim=-1).to(x.dtype)
