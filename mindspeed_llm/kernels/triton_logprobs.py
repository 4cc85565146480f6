"""Triton kernel for per-token log-probs and entropy from vocab-parallel logits (forward and backward).

Same contract and math as :func:`mindspeed_llm.rl.logprobs.vocab_parallel_logprobs` (see its module
docstring): ``logits`` is this tensor-parallel rank's shard ``[tokens, V / TP]`` (bf16, fp16 or fp32),
``targets`` global ids, ``z = logits / T``, fp32 accumulation, the result identical on every rank, the
gradient in the logits' dtype. What differs is how the per-row work runs:

* forward: ONE pass over the logits, one program per token. It walks the shard in ``BLOCK_V`` column
  blocks with an online softmax and keeps, relative to the running local max ``m_r``, ``s_r = sum
  exp(z - m_r)`` and ``w_r = sum exp(z - m_r)(z - m_r)``; when the max grows from ``m`` to ``m'`` both
  are rescaled: ``s <- s e^(m - m')``, ``w <- e^(m - m')(w + (m - m') s)``. It also reads the target
  logit when this shard owns the target. Across TP ranks: an all-reduce MAX of ``m_r`` gives ``M``; each
  rank moves its sums to ``M`` with the same rescale (``[tokens]`` torch ops) and one all-reduce SUM adds
  ``s``, the target logit, the ownership count and ``w``. So the communication is the torch path's (one
  MAX of ``[tokens]``, one SUM of ``[3 or 4, tokens]``) and the logits are read once instead of twice.
  ``log Z = M + log s``, ``logp = z_y - log Z``, ``H = log s - w / s``.
* backward: one program per (token, ``BLOCK_V`` column block), no communication: ``log p_j = z_j -
  log Z``, ``dz_j = -p_j (g_logp + g_H (log p_j + H)) + g_logp 1[j = y]``, ``d logits = dz / T``,
  stored in the logits' dtype. Saved per token: ``log Z``, ``H`` and the local target column (-1 when
  another rank owns it); the logits themselves are saved, as in the torch path.

Memory: no ``[tokens, vocab]`` fp32 buffer at all (the torch path has a two-chunk one); the gradient is
the only full-size allocation, as in any backward.

Importing this module imports Triton and defines the kernels; set ``TRITON_INTERPRET=1`` *before* the
import to run them on CPU tensors with Triton's interpreter (that is how tests/dist/test_triton_logprobs.py
checks them on machines without a GPU). Block sizes and warp counts are untuned defaults: no GPU was
available when this was written.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

__all__ = ["triton_vocab_parallel_logprobs", "FWD_BLOCK_V", "BWD_BLOCK_V"]

# Column block per program step (powers of two; capped by the shard's width rounded up).
FWD_BLOCK_V = 4096
BWD_BLOCK_V = 4096


@triton.jit
def _logprobs_fwd_kernel(
    logits_ptr, stride_row, targets_ptr, vocab_start, vocab_shard, temperature,
    max_ptr, stats_ptr, n_rows,
    WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride_row can pass 2**31 at long contexts x large vocab
    row_ptr = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)

    # First block outside the loop, so the running max starts finite (no -inf - -inf in the rescale).
    mask = cols < vocab_shard
    z = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32) / temperature
    m = tl.max(z, axis=0)
    d = tl.where(mask, z - m, 0.0)  # masked columns: 0, not -inf (0 * -inf would be NaN before the where)
    e = tl.where(mask, tl.exp(d), 0.0)
    s = tl.sum(e, axis=0)
    w = tl.sum(e * d, axis=0)
    for start in range(BLOCK_V, vocab_shard, BLOCK_V):
        c = start + cols
        mask = c < vocab_shard
        z = tl.load(row_ptr + c, mask=mask, other=float("-inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, tl.max(z, axis=0))
        alpha = tl.exp(m - m_new)
        d = tl.where(mask, z - m_new, 0.0)
        e = tl.where(mask, tl.exp(d), 0.0)
        w = alpha * (w + (m - m_new) * s) + tl.sum(e * d, axis=0)
        s = alpha * s + tl.sum(e, axis=0)
        m = m_new

    # Target logit, read only by the rank whose shard holds the target id.
    local = tl.load(targets_ptr + row) - vocab_start
    owned = (local >= 0) & (local < vocab_shard)
    z_y = tl.load(row_ptr + tl.where(owned, local, 0), mask=owned, other=0.0).to(tl.float32) / temperature
    z_y = tl.where(owned, z_y, 0.0)

    tl.store(max_ptr + row, m)
    tl.store(stats_ptr + row, s)
    tl.store(stats_ptr + n_rows + row, z_y)
    tl.store(stats_ptr + 2 * n_rows + row, owned.to(tl.float32))
    if WITH_ENTROPY:
        tl.store(stats_ptr + 3 * n_rows + row, w)


@triton.jit
def _logprobs_bwd_kernel(
    logits_ptr, stride_row, grad_ptr, grad_stride_row, log_z_ptr, entropy_ptr, grad_logp_ptr, grad_ent_ptr,
    local_target_ptr, vocab_shard, temperature,
    HAS_GRAD_LOGP: tl.constexpr, HAS_GRAD_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < vocab_shard
    z = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32) / temperature
    log_p = z - tl.load(log_z_ptr + row)
    p = tl.exp(log_p)
    coef = tl.zeros([BLOCK_V], dtype=tl.float32)
    if HAS_GRAD_ENT:
        coef = (log_p + tl.load(entropy_ptr + row)) * tl.load(grad_ent_ptr + row)
    if HAS_GRAD_LOGP:
        g_lp = tl.load(grad_logp_ptr + row)
        coef = coef + g_lp
    dz = -(coef * p)
    if HAS_GRAD_LOGP:
        target = tl.load(local_target_ptr + row)  # -1 when another rank owns the target: no one-hot term
        dz = dz + tl.where(cols == target, g_lp, 0.0)
    dz = dz / temperature
    tl.store(grad_ptr + row * grad_stride_row + cols, dz.to(grad_ptr.dtype.element_ty), mask=mask)


def _group_world_rank(group):
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _block(width, cap):
    return max(16, min(int(cap), triton.next_power_of_2(max(1, int(width)))))


def _warps(block):
    return 8 if block >= 2048 else 4


class _TritonVocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, temperature, with_entropy, fwd_block, bwd_block):
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        targets = targets.contiguous()
        n_tokens, vocab_shard = logits.shape
        world, rank = _group_world_rank(group)
        vocab_start = rank * vocab_shard
        f32 = torch.float32
        n_stats = 4 if with_entropy else 3
        row_max = torch.empty(n_tokens, dtype=f32, device=logits.device)
        stats = torch.empty(n_stats, n_tokens, dtype=f32, device=logits.device)
        if n_tokens > 0:
            block = _block(vocab_shard, fwd_block)
            _logprobs_fwd_kernel[(n_tokens,)](
                logits, logits.stride(0), targets, vocab_start, vocab_shard, temperature,
                row_max, stats, n_tokens,
                WITH_ENTROPY=with_entropy, BLOCK_V=block, num_warps=_warps(block),
            )
        if world > 1:
            # Move each rank's sums from its own max to the global one before adding them up.
            global_max = row_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
            shift = row_max - global_max  # <= 0
            scale = torch.exp(shift)
            if with_entropy:
                stats[3] = scale * (stats[3] + shift * stats[0])
            stats[0] = stats[0] * scale
            row_max = global_max
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)

        log_sum = torch.log(stats[0])
        log_z = row_max + log_sum
        logp = stats[1] - log_z
        # A target no rank owns (outside [0, V)) gives NaN, as in the torch path.
        logp = torch.where(stats[2] == 1, logp, torch.full_like(logp, float("nan")))
        local_target = targets - vocab_start
        local_target = torch.where((local_target >= 0) & (local_target < vocab_shard), local_target,
                                   torch.full_like(local_target, -1))
        ctx.temperature = temperature
        ctx.with_entropy = with_entropy
        ctx.bwd_block = bwd_block
        ctx.set_materialize_grads(False)
        if with_entropy:
            entropy = log_sum - stats[3] / stats[0]
            ctx.save_for_backward(logits, local_target, log_z, entropy)
            return logp, entropy
        ctx.save_for_backward(logits, local_target, log_z)
        return logp

    @staticmethod
    def backward(ctx, *grad_outputs):
        if ctx.with_entropy:
            logits, local_target, log_z, entropy = ctx.saved_tensors
            grad_logp, grad_ent = grad_outputs
        else:
            logits, local_target, log_z = ctx.saved_tensors
            (grad_logp,), grad_ent, entropy = grad_outputs, None, None
        none = (None,) * 6
        if not ctx.needs_input_grad[0] or (grad_logp is None and grad_ent is None):
            return (None,) + none
        n_tokens, vocab_shard = logits.shape
        grad = torch.empty((n_tokens, vocab_shard), dtype=logits.dtype, device=logits.device)
        if n_tokens == 0:
            return (grad,) + none
        f32 = torch.float32
        g_lp = grad_logp.to(f32).contiguous() if grad_logp is not None else log_z  # placeholder when unused
        g_h = grad_ent.to(f32).contiguous() if grad_ent is not None else log_z
        ent = entropy if entropy is not None else log_z
        block = _block(vocab_shard, ctx.bwd_block)
        _logprobs_bwd_kernel[(n_tokens, triton.cdiv(vocab_shard, block))](
            logits, logits.stride(0), grad, grad.stride(0), log_z, ent, g_lp, g_h,
            local_target, vocab_shard, ctx.temperature,
            HAS_GRAD_LOGP=grad_logp is not None, HAS_GRAD_ENT=grad_ent is not None,
            BLOCK_V=block, num_warps=_warps(block),
        )
        return (grad,) + none


def triton_vocab_parallel_logprobs(logits, targets, tp_group=None, temperature=1.0, with_entropy=False,
                                   fwd_block=None, bwd_block=None):
    """Triton version of ``vocab_parallel_logprobs`` on flattened inputs: ``logits [tokens, V / TP]``,
    ``targets [tokens]`` (global ids, on the logits' device). Returns ``logp`` or ``(logp, entropy)``
    (fp32 ``[tokens]``). ``fwd_block`` / ``bwd_block`` override the column block (tests use small
    ones to run the multi-block paths on tiny vocabularies)."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"expects logits [tokens, vocab_shard] and targets [tokens]; got {tuple(logits.shape)} "
                         f"and {tuple(targets.shape)}")
    temperature = float(temperature)
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    return _TritonVocabParallelLogProbs.apply(
        logits, targets.long(), tp_group, temperature, bool(with_entropy),
        fwd_block or FWD_BLOCK_V, bwd_block or BWD_BLOCK_V,
    )
