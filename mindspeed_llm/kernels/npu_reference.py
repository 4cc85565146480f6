"""Plain-torch references of three fused `torch_npu` ops: what the tests' CPU stand-in of `torch_npu` installs as
`torch_npu.npu_rms_norm`, `npu_swiglu`, `npu_rotary_position_embedding`, and what `scripts/npu_check.py` checks the
NPU's ops against (here in the package, so that a device script imports no test module).

Written from torch_npu's documented API (the Ascend Extension for PyTorch operator reference, and MindSpeed's own
calls of these ops in its fused RMSNorm / SwiGLU / RoPE); not checked against an NPU. The facts relied on:

* `npu_rms_norm(x, gamma, epsilon=1e-6) -> (y, rstd)`: `rstd = 1 / sqrt(mean(x**2) + epsilon)` over the trailing
  `gamma.dim()` dimensions of `x`, `y = x * rstd * gamma`. `y` has `x`'s dtype and shape; `rstd` is float32 with
  `x`'s shape, those trailing dimensions kept as 1 (it is what the backward reads). Computed here in float32 and
  cast once at the end (the kernel's fp16 / bf16 path accumulates in float32; its exact rounding order is not
  documented, so an NPU may differ from this in the last bit of a half-precision `y`).
* `npu_swiglu(x, dim=-1)`: `x` split into two equal halves `a, b` along `dim` (`a` the first), `silu(a) * b`; the
  size of `dim` must be even. This is megatron's `swiglu` (`torch.chunk(x, 2, dim=-1)`, `silu(x[0]) * x[1]`).
* `npu_rotary_position_embedding(x, r1, r2, mode=0)`: `out = x * r1 + rotate(x) * r2` (`r1` = cos, `r2` = sin,
  already laid out per element of the last dimension by the caller), all three four-dimensional, `x` in one of the
  layouts BNSD / BSND / SBND (the op is not told which). `mode` 0 = "rotate_half" (GPT-NeoX / Llama:
  `rotate(x) = cat(-x[..., D/2:], x[..., :D/2])`), 1 = "interleave" (GPT-J: the pairs `(x[2i], x[2i+1])` become
  `(-x[2i+1], x[2i])`). D even and below 896. The tables: mode 0 takes 11SD / B1SD / BNSD for BNSD (1S1D / BS1D /
  BSND for BSND, S11D / SB1D / SBND for SBND); mode 1 only 11SD (1S1D, S11D): one table for the whole batch.
  Sources: MindSpeed's operator page (docs/zh/ops/npu_rotary_position_embedding.md: the equivalent computation, the
  backward's inputs dy, cos, sin and optionally x) and torch_npu's npu_rotary_mul page (the same layout table, and:
  the forward's input is kept for the backward, so with tables that need no gradient the fused op holds more memory
  than the unfused ops). The reference enforces what it can without knowing the layout: the parity of D, D < 896,
  tables that broadcast to `x` with its D, and in mode 1 tables of one row per position (at most one of the first
  three dimensions other than 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

RMS_NORM_DEFAULT_EPSILON = 1e-6
ROTARY_MODES = {0: "rotate_half", 1: "interleave"}
ROTARY_MAX_DIM = 896  # D < 896


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = RMS_NORM_DEFAULT_EPSILON):
    """`(y, rstd)` as `torch_npu.npu_rms_norm` documents them (see the module docstring)."""
    if gamma.dim() < 1 or tuple(x.shape[x.dim() - gamma.dim():]) != tuple(gamma.shape):
        raise ValueError(f"npu_rms_norm: gamma {tuple(gamma.shape)} must match the trailing dimensions of x "
                         f"{tuple(x.shape)}")
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = (x32 * rstd * gamma.float()).to(x.dtype)
    return y, rstd


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """`silu(first half) * second half` of `x` along `dim` (see the module docstring)."""
    if x.size(dim) % 2:
        raise ValueError(f"npu_swiglu: x {tuple(x.shape)} has an odd size along dim {dim}; it is split in two halves")
    first, second = torch.chunk(x, 2, dim=dim)
    return F.silu(first) * second


def _rotate(x: torch.Tensor, mode: int) -> torch.Tensor:
    if mode == 0:
        first, second = torch.chunk(x, 2, dim=-1)
        return torch.cat((-second, first), dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def npu_rotary_position_embedding(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, mode: int = 0) -> torch.Tensor:
    """`x * r1 + rotate(x) * r2` with `rotate` picked by `mode` (see the module docstring)."""
    if mode not in ROTARY_MODES:
        raise ValueError(f"npu_rotary_position_embedding: mode={mode!r}; expected 0 (rotate_half) or 1 (interleave)")
    if x.dim() != 4 or r1.dim() != 4 or r2.dim() != 4:
        raise ValueError(f"npu_rotary_position_embedding: x, r1, r2 must be 4-D (BNSD / BSND / SBND); got "
                         f"{tuple(x.shape)}, {tuple(r1.shape)}, {tuple(r2.shape)}")
    if x.size(-1) % 2 or x.size(-1) >= ROTARY_MAX_DIM:
        raise ValueError(f"npu_rotary_position_embedding: the last dimension of x {tuple(x.shape)} must be even and "
                         f"below {ROTARY_MAX_DIM}")
    for name, r in (("r1", r1), ("r2", r2)):
        if r.size(-1) != x.size(-1) or torch.broadcast_shapes(r.shape, x.shape) != x.shape:
            raise ValueError(f"npu_rotary_position_embedding: {name} {tuple(r.shape)} must broadcast to x "
                             f"{tuple(x.shape)} with x's last dimension")
        if mode == 1 and sum(size != 1 for size in r.shape[:3]) > 1:
            raise ValueError(f"npu_rotary_position_embedding: mode 1 takes one table row per position (11SD / 1S1D / "
                             f"S11D); {name} is {tuple(r.shape)}")
    return x * r1 + _rotate(x, mode) * r2
