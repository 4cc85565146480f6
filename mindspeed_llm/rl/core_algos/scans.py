"""Reverse scans over the response: GAE's advantages and REINFORCE++'s discounted returns without a Python loop
over the response length ``T``.

Both are the first-order linear recurrence run from the end of the row::

    x_t = a_t + c_t * x_{t+1}        (x_T = 0, t = T-1 .. 0)                                       (1)

* GAE (:func:`gae_scan`): ``a_t = delta_t = r_t + gamma * V_{t+1} - V_t`` (``V`` the values times the value mask,
  ``V_T = 0``) and the constant ``c_t = gamma * lam``; the returns are ``x + V``.
* REINFORCE++ (:func:`discounted_returns`): ``a_t = r_t`` and ``c_t = gamma * m_{t+1}`` (``m`` the response mask,
  ``m_T = 0``): a masked position cuts the return, nothing after the response counts.

:func:`reverse_linear_scan` is the torch implementation of (1), on every device and the reference of the Triton
kernel. The row is cut into chunks of ``CHUNK`` (16) positions, all scanned at once in ``log2 CHUNK`` (4) steps of
whole-tensor ops: at the step of span ``s`` every block of ``2 s`` positions has both halves scanned (each with a
zero carry at its end), and the earlier half gets the later half's first value times the product of the
coefficients from each position to the half's end (``c^(s - i)`` for a constant ``c``, a running product tensor
otherwise), in place (the two halves never overlap). The chunks' first positions are then scanned the same way,
recursively (``T / 16`` positions, then ``T / 256``, ...), and one multiply-add brings every position the value at
the next chunk's start times its product to its chunk's end. That is about ``6 log16 T`` kernel launches (about 30
at T = 16k), about three passes over the ``[B, T]`` tensor, and no launch per position. A constant coefficient is a
Python float whose powers are computed in float64. When an input needs a gradient the steps write fresh copies
instead of in place (autograd keeps what it saved), so the scan is differentiable.

Precision: the same products and sums as the loop in another order (a tree of depth ``log2 T`` instead of a
chain of ``T``), in the inputs' dtype. In fp32 the results differ from the loop's by rounding only: against a
float64 loop both errors are a few ``eps * sum_k |c^(k-t) a_k|`` (bounded by ``T`` such units for the loop, by
about ``2 log2 T`` for the scan), which is the tolerance ``tests/unit/test_scans.py`` states. A non-finite ``a_k``
makes the positions before ``k`` (of its row) non-finite, as in the loop.

On CUDA (and Ascend with Triton-Ascend) :func:`gae_scan` and :func:`discounted_returns` run
``mindspeed_llm.kernels.triton_scans`` instead (one launch, fp32 accumulation; forward only, so the torch path
runs when an input needs a gradient); ``MINDSPEED_SCAN_KERNEL=torch`` keeps this path (``mindspeed_llm.kernels``).
:func:`gae_scan_loop` and :func:`discounted_returns_loop` are the definitions, one step per position (what
``compute_gae`` and REINFORCE++ ran before): the tests and ``benchmarks/rl_math.py`` compare against them; no
stage calls them.
"""

from __future__ import annotations

from typing import Tuple, Union

import torch
import torch.nn.functional as F

from mindspeed_llm.kernels import select_kernel

CHUNK = 16  # positions scanned together (8-64 within noise on CPU at B 256, T 16k; fewer means more launches)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _powers(c: float, count: int, like: torch.Tensor) -> torch.Tensor:
    """``[c^count, c^(count-1), ..., c^1]`` (float64 powers, then ``like``'s dtype and device)."""
    return torch.tensor([float(c) ** (count - i) for i in range(count)], dtype=like.dtype, device=like.device)


def _scan_chunks_(x: torch.Tensor, c, grad: bool):
    """Scan every run of ``CHUNK`` positions of ``x`` (``[..., n, CHUNK]``, this call's own) with a zero carry at
    its end, in place. For a tensor ``c`` (``x``'s shape, own) it becomes the products ``prod_{j >= t} c_j`` to the
    chunk's end. With ``grad`` every step writes fresh copies instead, so autograd keeps what it saved."""
    lead = x.shape[:-1]
    tensor_c = isinstance(c, torch.Tensor)
    span = 1
    while span < CHUNK:
        blocks = (*lead, CHUNK // (2 * span), 2, span)
        src, c_src = x, c
        if grad:
            x = x.clone()
            c = c.clone() if tensor_c else c
        later_first = src.view(blocks)[..., 1, :1]  # the value each block's later half carries into its first half
        head = x.view(blocks)[..., 0, :]
        if tensor_c:
            coef = c_src.view(blocks)[..., 0, :]  # products to the first half's end
            if grad:
                head.copy_(torch.addcmul(src.view(blocks)[..., 0, :], coef, later_first))
                c.view(blocks)[..., 0, :].copy_(coef * c_src.view(blocks)[..., 1, :1])
            else:
                head.addcmul_(coef, later_first)
                coef.mul_(c_src.view(blocks)[..., 1, :1])
        else:
            if grad:
                head.copy_(torch.addcmul(src.view(blocks)[..., 0, :], _powers(c, span, x), later_first))
            else:
                head.addcmul_(_powers(c, span, x), later_first)
        span *= 2
    return x, c


def _scan_(x: torch.Tensor, c, grad: bool) -> torch.Tensor:
    """(1) along the last dim of ``x``, this call's own contiguous tensor (written in place without ``grad``);
    ``c`` a float or this call's own tensor of ``x``'s shape."""
    length = x.size(-1)
    lead = x.shape[:-1]
    tensor_c = isinstance(c, torch.Tensor)
    chunks = -(-length // CHUNK)
    pad = chunks * CHUNK - length
    if pad:  # padding: a = 0 (and c = 0), so x = 0 there
        x = F.pad(x, (0, pad))
        c = F.pad(c, (0, pad)) if tensor_c else c
    x = x.view(*lead, chunks, CHUNK)
    c = c.view(*lead, chunks, CHUNK) if tensor_c else c
    x, to_end = _scan_chunks_(x, c, grad)  # to_end: a tensor c's products to each chunk's end
    if chunks > 1:
        if tensor_c:
            chunk_coef = to_end[..., 0].clone(memory_format=torch.contiguous_format)
        else:
            to_end, chunk_coef = _powers(c, CHUNK, x), float(c) ** CHUNK
        starts = _scan_(x[..., 0].clone(memory_format=torch.contiguous_format), chunk_coef, grad)
        next_start = F.pad(starts[..., 1:], (0, 1)).unsqueeze(-1)  # x at the next chunk's start (0 after the last)
        x = torch.addcmul(x, to_end, next_start) if grad else x.addcmul_(to_end, next_start)
    return x.view(*lead, chunks * CHUNK)[..., :length]


def reverse_linear_scan(a: torch.Tensor, c: Union[float, torch.Tensor]) -> torch.Tensor:
    """``x_t = a_t + c_t x_{t+1}`` along the last dim, ``x_T = 0`` (module docstring): ``a`` ``[..., T]``; ``c``
    a float (a constant coefficient) or a tensor broadcastable to ``a``. Returns ``x``, ``a``'s shape, in the
    dtype of ``a`` and ``c``; differentiable; the inputs are not written. No kernel launch per position."""
    grad = _needs_grad(a, c)
    if isinstance(c, torch.Tensor):
        dtype = torch.result_type(a, c)
        c = c.to(dtype).expand_as(a).clone(memory_format=torch.contiguous_format)
    else:
        dtype = a.dtype
    x = a.to(dtype).clone(memory_format=torch.contiguous_format)
    return x if x.size(-1) == 0 else _scan_(x, c, grad)


def gae_scan(rewards: torch.Tensor, values: torch.Tensor, value_mask: torch.Tensor, gamma: float, lam: float,
             *, kernel=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """GAE's raw advantages and returns (before any whitening), ``[B, T]`` each::

        V_t     = values_t * value_mask_t,  V_T = 0
        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}          (A_T = 0)
        R_t     = A_t + V_t

    The recursion runs over every position, as TRL 1.12 ``PPOTrainer.train`` (see ``rewards.compute_gae``).
    ``kernel``: ``MINDSPEED_SCAN_KERNEL``'s choices, for this call (``mindspeed_llm.kernels.select_kernel``)."""
    if (select_kernel("scans", rewards.device, kernel) == "triton"
            and not (torch.is_grad_enabled() and (rewards.requires_grad or values.requires_grad))):
        from mindspeed_llm.kernels.triton_scans import triton_gae

        return triton_gae(rewards, values, value_mask, gamma, lam)
    values = values * value_mask.to(values.dtype)
    grad = _needs_grad(rewards, values)
    if grad:
        delta = rewards + gamma * F.pad(values[:, 1:], (0, 1)) - values  # (r_t + gamma V_{t+1}) - V_t
    else:  # the same in two passes, into a tensor the scan then owns
        delta = torch.empty(values.shape, dtype=torch.result_type(rewards, values), device=values.device)
        torch.add(rewards[:, :-1], values[:, 1:], alpha=gamma, out=delta[:, :-1])
        delta[:, -1:] = rewards[:, -1:]
        delta.sub_(values)
    advantages = delta if delta.size(-1) == 0 else _scan_(delta, gamma * lam, grad)
    return advantages, advantages + values


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float, *, kernel=None) -> torch.Tensor:
    """REINFORCE++'s returns ``G_t = r_t + gamma * m_{t+1} * G_{t+1}`` (``G_T = 0``, ``m_T = 0``), ``[B, T]``: a
    position outside ``mask`` stops the return of the positions before it. ``kernel`` as in :func:`gae_scan`."""
    if (select_kernel("scans", rewards.device, kernel) == "triton"
            and not (torch.is_grad_enabled() and rewards.requires_grad)):
        from mindspeed_llm.kernels.triton_scans import triton_discounted_returns

        return triton_discounted_returns(rewards, mask, gamma)
    coef = torch.zeros_like(rewards)  # gamma * m_{t+1}, m_T = 0
    coef[:, :-1] = mask[:, 1:]
    if gamma != 1.0:
        coef.mul_(gamma)
    if rewards.size(-1) == 0:
        return rewards.clone()
    return _scan_(rewards.clone(memory_format=torch.contiguous_format), coef, _needs_grad(rewards))


def gae_scan_loop(rewards, values, value_mask, gamma, lam) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`gae_scan` by its definition, one step per position (TRL's reverse loop; tests and benchmarks)."""
    values = values * value_mask.to(values.dtype)
    length = rewards.size(1)
    last_gae = torch.zeros_like(rewards[:, 0])
    reversed_adv = []
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = delta + gamma * lam * last_gae
        reversed_adv.append(last_gae)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    return advantages, advantages + values


def discounted_returns_loop(rewards, mask, gamma) -> torch.Tensor:
    """:func:`discounted_returns` by its definition, one step per position (verl's loop; tests and benchmarks)."""
    mask = mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.size(1))):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]  # a padding position cuts the return: nothing after the response counts
    return returns
