"""Triton kernel for the reverse scans of ``core_algos.scans``: GAE's advantages and returns, and REINFORCE++'s
discounted returns, in ONE launch per call with fp32 accumulation.

Same contract and math as :func:`mindspeed_llm.rl.core_algos.scans.gae_scan` / ``discounted_returns`` (see that
module's docstring: ``x_t = a_t + c_t x_{t+1}``, ``x_T = 0``). The programs loop over the rows (one row each on CUDA,
a vector core's share on an NPU: ``kernels/launch.py``); a row is walked from its end in blocks
of ``BLOCK_T`` positions, loaded in reversed order so that a forward ``tl.associative_scan`` runs backwards in
time. The scan's elements are the pairs ``(c_t, a_t)`` (a step ``y -> a + c y``); the combine of an element with
the one before it in scan order is ``(c' c, a + c a')``. The carry, the value at the block's earliest position,
enters the next block as ``a += c * carry`` on its first element.

* GAE: ``a_t = r_t + gamma V_{t+1} - V_t`` with ``V = values * value_mask`` (read at ``t`` and ``t + 1``),
  ``c = gamma * lam``; stores the advantages and the returns ``x + V``.
* discounted returns: ``a_t = r_t``, ``c_t = gamma * m_{t+1}``; stores ``x``.

Loads are in the inputs' dtypes (bool masks are read as bytes), arithmetic in fp32, stores in the result dtype
of the torch path (``result_type(rewards, values)``, resp. the rewards' dtype). Forward only (no autograd):
``core_algos.scans`` takes the torch path when an input needs a gradient.

Importing this module imports Triton and defines the kernel; set ``TRITON_INTERPRET=1`` *before* the import to
run it on CPU tensors with Triton's interpreter (tests/dist/test_triton_rl_math.py). ``BLOCK_T`` and the warp count
are untuned defaults: no GPU was available when this was written. On Ascend (Triton-Ascend) it has never run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mindspeed_llm.kernels.launch import launch, vector_cores

__all__ = ["triton_gae", "triton_discounted_returns", "BLOCK_T", "LIVE_TILES"]

BLOCK_T = 1024  # positions per step of a row's program (a power of two; capped by the row's length rounded up)
# float32-sized tiles a step keeps live (loads, the scan's pairs and result, positions, masks): sizes the tile to the
# NPU's unified buffer (kernels/launch.py; an estimate, unverified until compiled by Triton-Ascend)
LIVE_TILES = 16


@triton.jit
def _step_combine(c_before, x_before, c, x):
    # (c_before, x_before) comes first in scan order (later in time): y = x + c * (x_before + c_before * y')
    return c_before * c, x + c * x_before


@triton.jit
def _reverse_scan_kernel(
    rewards_ptr, values_ptr, mask_ptr, out_ptr, returns_ptr,
    stride_r, stride_v, stride_m, stride_o, stride_ret, length, rows, gamma, coef,
    GAE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    lanes = tl.arange(0, BLOCK_T)
    # each program walks rows pid, pid + programs, ... (kernels/launch.py: one row each on CUDA, a core's share on NPU)
    for task in range(tl.program_id(0), rows, tl.num_programs(0)):
        _scan_row(rewards_ptr, values_ptr, mask_ptr, out_ptr, returns_ptr, stride_r, stride_v, stride_m, stride_o,
                  stride_ret, length, gamma, coef, tl.cast(task, tl.int64), lanes, GAE, BLOCK_T)


@triton.jit
def _scan_row(
    rewards_ptr, values_ptr, mask_ptr, out_ptr, returns_ptr,
    stride_r, stride_v, stride_m, stride_o, stride_ret, length, gamma, coef, row, lanes,
    GAE: tl.constexpr, BLOCK_T: tl.constexpr,
):
    carry = tl.full((), 0.0, tl.float32)
    for start in range(0, length, BLOCK_T):
        t = length - 1 - start - lanes  # descending positions: lane 0 is the block's latest
        valid = t >= 0
        has_next = valid & (t + 1 < length)
        r = tl.load(rewards_ptr + row * stride_r + t, mask=valid, other=0.0).to(tl.float32)
        if GAE:
            v = tl.load(values_ptr + row * stride_v + t, mask=valid, other=0.0).to(tl.float32)
            v = v * tl.load(mask_ptr + row * stride_m + t, mask=valid, other=0).to(tl.float32)
            v_next = tl.load(values_ptr + row * stride_v + t + 1, mask=has_next, other=0.0).to(tl.float32)
            v_next = v_next * tl.load(mask_ptr + row * stride_m + t + 1, mask=has_next, other=0).to(tl.float32)
            a = r + gamma * v_next - v
            c = tl.full((BLOCK_T,), coef, tl.float32)
        else:
            c = gamma * tl.load(mask_ptr + row * stride_m + t + 1, mask=has_next, other=0).to(tl.float32)
            a = r
        a = tl.where(lanes == 0, a + c * carry, a)
        _, x = tl.associative_scan((c, a), 0, _step_combine)
        tl.store(out_ptr + row * stride_o + t, x.to(out_ptr.dtype.element_ty), mask=valid)
        if GAE:
            tl.store(returns_ptr + row * stride_ret + t, (x + v).to(returns_ptr.dtype.element_ty), mask=valid)
        carry = tl.sum(tl.where(lanes == BLOCK_T - 1, x, 0.0), axis=0)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with unit stride along T (a copy only when it has not); bool read as bytes (no copy)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.view(torch.uint8) if x.dtype == torch.bool else x


def _launch_for(device, batch: int, length: int, block_t, programs):
    """Grid and tile (kernels/launch.py); `block_t` / `programs` override them (tests: the carry between blocks on
    short rows, and programs that loop over several rows, as on an NPU)."""
    plan = launch(batch, length, block_t or BLOCK_T, LIVE_TILES, device.type, vector_cores(device))
    return (min(int(programs), batch) if programs else plan.programs), plan.block


def _check(name, *tensors):
    shape = tensors[0].shape
    if len(shape) != 2 or any(t.shape != shape for t in tensors):
        raise ValueError(f"{name} expects [B, T] tensors of one shape; got {[tuple(t.shape) for t in tensors]}")


def triton_gae(rewards, values, value_mask, gamma, lam, block_t=None, programs=None):
    """``core_algos.scans.gae_scan`` in one launch: ``(advantages, returns)``, ``[B, T]`` each. ``block_t`` /
    ``programs`` override the tile and the grid (`_launch`)."""
    _check("triton_gae", rewards, values, value_mask)
    dtype = torch.result_type(rewards, values)
    batch, length = rewards.shape
    advantages = torch.empty((batch, length), dtype=dtype, device=rewards.device)
    returns = torch.empty_like(advantages)
    if batch and length:
        r, v, m = _rows(rewards), _rows(values), _rows(value_mask)
        grid, block = _launch_for(rewards.device, batch, length, block_t, programs)
        _reverse_scan_kernel[(grid,)](
            r, v, m, advantages, returns, r.stride(0), v.stride(0), m.stride(0), advantages.stride(0),
            returns.stride(0), length, batch, float(gamma), float(gamma) * float(lam),
            GAE=True, BLOCK_T=block, num_warps=4,
        )
    return advantages, returns


def triton_discounted_returns(rewards, mask, gamma, block_t=None, programs=None):
    """``core_algos.scans.discounted_returns`` in one launch: ``G`` ``[B, T]``."""
    _check("triton_discounted_returns", rewards, mask)
    batch, length = rewards.shape
    out = torch.empty((batch, length), dtype=rewards.dtype, device=rewards.device)
    if batch and length:
        r, m = _rows(rewards), _rows(mask)
        grid, block = _launch_for(rewards.device, batch, length, block_t, programs)
        _reverse_scan_kernel[(grid,)](
            r, r, m, out, out, r.stride(0), 0, m.stride(0), out.stride(0), 0, length, batch, float(gamma), 0.0,
            GAE=False, BLOCK_T=block, num_warps=4,
        )
    return out
