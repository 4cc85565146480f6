"""Reverse scans over the response: GAE's advantages and REINFORCE++'s discounted returns without a Python loop
over the response length ``T``.

Both are the first-order linear recurrence run from the end of the row::

    x_t = a_t + c_t * x_{t+1}        (x_T = 0, t = T-1 .. 0)                                       (1)

* GAE (:func:`gae_scan`): ``a_t = delta_t = r_t + gamma * V_{t+1} - V_t`` (``V`` the values times the value mask,
  ``V_T = 0``) and the constant ``c_t = gamma * lam``; the returns are ``x + V``.
* REINFORCE++ (:func:`discounted_returns`): ``a_t = r_t`` and ``c_t = gamma * m_{t+1}`` (``m`` the response mask,
  ``m_T = 0``): a masked position cuts the return, nothing after the response counts.

:func:`reverse_linear_scan` is the torch implementation of (1), on every device and the reference of the Triton
kernel. One step of (1) maps ``x_{t+1}`` to ``a_t + c_t x_{t+1}``; two steps compose as
``(C, A) then (C', A') = (C C', A + C A')``, which is associative, so the row can be scanned in doubling steps
(Hillis-Steele): after the step of span ``s`` position ``t`` holds the composition over ``[t, t + s)``, and
``log2(span)`` steps of whole-tensor ops finish a span. Done on the full row that is ``log2 T`` passes over the
``[B, T]`` tensor; instead the row is cut into chunks of ``CHUNK`` (16) positions: ``log2 CHUNK`` (4) doubling
steps scan every chunk at once (each position then has its value with a zero carry and the product of the
coefficients to its chunk's end), the chunks' first positions are scanned the same way, recursively
(``T / 16`` positions, then ``T / 256``, ...), and one multiply-add brings each chunk the value at the start of the
next. About ``6 + 6 log16 T`` kernel launches (about 40 at T = 16k), each over the tensor or a 16x smaller one,
and no launch per position. A constant coefficient is a Python float: the doubling steps use its powers
(``c^s``, computed in float64) instead of a tensor of products.

Precision: the same products and sums as the loop in another order (a tree of depth ``log2 T`` instead of a
chain of ``T``), in the inputs' dtype. In fp32 the results differ from the loop's by rounding only: against a
float64 loop both errors are a few ``eps * sum_k |c^(k-t) a_k|`` (the loop's grows like ``T``, the scan's like
``log T``), which is the tolerance ``tests/test_scans.py`` states. A non-finite ``a_k`` makes the positions
before ``k`` (of its row) non-finite, as in the loop.

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

CHUNK = 16  # positions scanned together by the doubling steps (measured best of 8-128 on CPU, benchmarks/README)


def _double(a: torch.Tensor, c):
    """Doubling steps of (1) along the last dim of ``a`` (``[..., L]``, ``L <= CHUNK`` in use). Returns ``x``, the
    scan with ``x_L = 0``, and, for a tensor ``c``, the products ``prod_{j >= t} c_j`` to the end. Out of place
    (fresh tensors, written through views: differentiable, and no copy of a strided slice)."""
    length = a.size(-1)
    span = 1
    power = c  # c^span for a constant coefficient
    while span < length:
        keep = length - span
        x = a.clone()
        if isinstance(c, torch.Tensor):
            x[..., :keep].addcmul_(c[..., :keep], a[..., span:])
            products = c.clone()
            products[..., :keep].mul_(c[..., span:])
            c = products
        else:
            x[..., :keep].add_(a[..., span:], alpha=power)
            power = power * power
        a = x
        span *= 2
    return a, c


def _scan(a: torch.Tensor, c) -> torch.Tensor:
    """(1) along the last dim of ``a``; ``c`` a float or a tensor of ``a``'s shape."""
    length = a.size(-1)
    if length <= CHUNK:
        return _double(a, c)[0]
    chunks = -(-length // CHUNK)
    pad = chunks * CHUNK - length
    lead = a.shape[:-1]
    if pad:  # padding: a = 0 (and c = 0), so x = 0 there
        a = F.pad(a, (0, pad))
        c = F.pad(c, (0, pad)) if isinstance(c, torch.Tensor) else c
    a = a.reshape(*lead, chunks, CHUNK)
    if isinstance(c, torch.Tensor):
        c = c.reshape(*lead, chunks, CHUNK)
    x, to_end = _double(a, c)  # every chunk with a zero carry; to_end: the products to the chunk's end
    if isinstance(c, torch.Tensor):
        chunk_coef = to_end[..., 0]
    else:
        # c^(CHUNK - i) from position i to the chunk's end, and c^CHUNK over a whole chunk (float64 powers).
        to_end = torch.tensor([float(c) ** (CHUNK - i) for i in range(CHUNK)], dtype=a.dtype, device=a.device)
        chunk_coef = float(c) ** CHUNK
    starts = _scan(x[..., 0], chunk_coef)  # x at each chunk's first position
    next_start = F.pad(starts[..., 1:], (0, 1))  # x at the next chunk's first position (0 after the last)
    x = torch.addcmul(x, to_end, next_start.unsqueeze(-1))  # out of place: the level above read x[..., 0]
    return x.view(*lead, chunks * CHUNK)[..., :length]


def reverse_linear_scan(a: torch.Tensor, c: Union[float, torch.Tensor]) -> torch.Tensor:
    """``x_t = a_t + c_t x_{t+1}`` along the last dim, ``x_T = 0`` (module docstring): ``a`` ``[..., T]``; ``c``
    a float (a constant coefficient) or a tensor broadcastable to ``a``. Returns ``x``, ``a``'s shape, in the
    dtype of ``a`` and ``c``; differentiable. No kernel launch per position."""
    if isinstance(c, torch.Tensor):
        dtype = torch.result_type(a, c)
        c = c.to(dtype).expand_as(a)
    else:
        dtype = a.dtype
    a = a.to(dtype)
    return a.clone() if a.size(-1) == 0 else _scan(a, c)


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
    delta = rewards.to(torch.result_type(rewards, values), copy=True)  # (r_t + gamma V_{t+1}) - V_t, the loop's order
    delta[:, :-1].add_(values[:, 1:], alpha=gamma)
    delta.sub_(values)
    advantages = reverse_linear_scan(delta, gamma * lam)
    return advantages, advantages + values


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float, *, kernel=None) -> torch.Tensor:
    """REINFORCE++'s returns ``G_t = r_t + gamma * m_{t+1} * G_{t+1}`` (``G_T = 0``, ``m_T = 0``), ``[B, T]``: a
    position outside ``mask`` stops the return of the positions before it. ``kernel`` as in :func:`gae_scan`."""
    if (select_kernel("scans", rewards.device, kernel) == "triton"
            and not (torch.is_grad_enabled() and rewards.requires_grad)):
        from mindspeed_llm.kernels.triton_scans import triton_discounted_returns

        return triton_discounted_returns(rewards, mask, gamma)
    next_mask = F.pad(mask.to(rewards.dtype)[:, 1:], (0, 1))
    return reverse_linear_scan(rewards, gamma * next_mask)


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
