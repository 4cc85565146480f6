"""Per-token log-probabilities (and entropy) from vocab-parallel logits, without a full softmax.

:func:`vocab_parallel_logprobs` takes the logits shard a tensor-parallel (TP) rank holds and returns,
for every token, ``log softmax(logits / T)[target]`` over the *full* vocabulary and optionally the
entropy of that distribution. It is a custom ``torch.autograd.Function`` that walks the tokens in
chunks, so the only fp32 ``[tokens, vocab]``-shaped memory it ever allocates is a two-chunk work
buffer (``2 x chunk_rows x vocab_shard`` fp32), in the forward and in the backward. The backward
recomputes the softmax chunk by chunk from the saved logits and two fp32 numbers per token.

Math, with ``z = logits / T`` (fp32) over the full vocabulary ``V``, target ``y``, ``p = softmax(z)``:

* ``m = max_j z_j`` (all-reduce MAX over the TP group), ``S = sum_j exp(z_j - m)`` (all-reduce SUM),
  ``log Z = m + log S``;
* ``logp = z_y - log Z``; ``z_y`` comes from the rank whose shard holds ``y`` (the others contribute
  0 to a SUM all-reduce);
* ``H = -sum_j p_j log p_j = log Z - E_p[z] = log S - sum_j exp(z_j - m)(z_j - m) / S``;
* gradients: ``d logp / d z_j = 1[j = y] - p_j``; ``d H / d z_j = -p_j (log p_j + H)``; and
  ``d / d logits = (d / d z) / T``. Each rank computes the gradient of its own shard; the backward
  needs no communication (``log Z`` and ``H`` are saved per token).

Forward communication: one all-reduce MAX of ``[tokens]`` and one all-reduce SUM of
``[3 or 4, tokens]`` fp32, for the whole call (not per chunk).

:func:`reference_logprobs` is the plain implementation (fp32 ``log_softmax`` + gather + entropy on
the full logits) used as the ground truth in tests and as the "naive" baseline in
benchmarks/logprobs.py.

The chunked torch path is device agnostic (CPU, CUDA, NPU). On CUDA devices, when Triton imports,
:func:`vocab_parallel_logprobs` runs ``mindspeed_llm.kernels.triton_logprobs`` instead (same contract
and math); ``MINDSPEED_LOGPROBS_KERNEL=torch`` keeps this path (``mindspeed_llm.kernels``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mindspeed_llm.kernels import select_logprobs_kernel

__all__ = ["vocab_parallel_logprobs", "reference_logprobs", "CPU_CHUNK_ELEMENTS", "ACCEL_CHUNK_ELEMENTS"]

# Auto chunk size: rows per chunk = CHUNK_ELEMENTS // vocab_shard, the size of each of the two fp32
# work buffers. On CPU a buffer that stays in cache is fastest (4 MiB; measured with
# benchmarks/logprobs.py, 2-8 MiB are within noise, 64 MiB is ~2x slower); on accelerators fewer, larger
# kernel launches win (64 MiB; not measured here, no accelerator was available).
CPU_CHUNK_ELEMENTS = 1 << 20
ACCEL_CHUNK_ELEMENTS = 1 << 24


def _group_world_rank(group):
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _chunk_rows(chunk_size, n_tokens, vocab_shard, device):
    if chunk_size is None:
        elements = CPU_CHUNK_ELEMENTS if device.type == "cpu" else ACCEL_CHUNK_ELEMENTS
        rows = max(1, elements // max(1, vocab_shard))
    else:
        rows = int(chunk_size)
        if rows < 1:
            raise ValueError(f"chunk_size must be >= 1 (got {chunk_size})")
    return max(1, min(rows, n_tokens))


def _load_scaled(dst, src, temperature):
    """dst <- float32(src) / temperature (dst is a preallocated fp32 view)."""
    dst.copy_(src)
    if temperature != 1.0:
        dst.div_(temperature)
    return dst


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, temperature, with_entropy, chunk_size):
        n_tokens, vocab_shard = logits.shape
        world, rank = _group_world_rank(group)
        device = logits.device
        f32 = torch.float32

        # Target ownership: rank r holds global ids [r * vocab_shard, (r + 1) * vocab_shard).
        local_idx = targets - rank * vocab_shard
        owned = (local_idx >= 0) & (local_idx < vocab_shard)
        safe_idx = torch.where(owned, local_idx, torch.zeros_like(local_idx))

        # Global row max of z = logits / T. Division by T > 0 is monotone, so max(x) / T == max(x / T)
        # exactly, and amax needs no fp32 copy of the logits.
        row_max = logits.amax(dim=-1).to(f32)
        if temperature != 1.0:
            row_max = row_max / temperature
        if world > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)

        # Rows of `stats` (all SUM-reduced together): sum exp(z - m), target logit z_y, ownership
        # count, and (for entropy) sum exp(z - m) * (z - m).
        n_stats = 4 if with_entropy else 3
        stats = torch.empty(n_stats, n_tokens, dtype=f32, device=device)
        target_z = logits.gather(1, safe_idx.unsqueeze(1)).squeeze(1).to(f32)
        if temperature != 1.0:
            target_z = target_z / temperature
        stats[1] = torch.where(owned, target_z, torch.zeros_like(target_z))
        stats[2] = owned.to(f32)

        rows = _chunk_rows(chunk_size, n_tokens, vocab_shard, device)
        work = torch.empty(2, rows, vocab_shard, dtype=f32, device=device)
        for start in range(0, n_tokens, rows):
            end = min(start + rows, n_tokens)
            r = end - start
            shifted = _load_scaled(work[0, :r], logits[start:end], temperature)
            shifted.sub_(row_max[start:end].unsqueeze(1))  # z - m
            expd = torch.exp(shifted, out=work[1, :r])  # exp(z - m)
            torch.sum(expd, dim=1, out=stats[0, start:end])
            if with_entropy:
                expd.mul_(shifted)
                torch.sum(expd, dim=1, out=stats[3, start:end])
        del work

        if world > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)

        log_sum = torch.log(stats[0])
        log_z = row_max + log_sum
        logp = stats[1] - log_z
        # A target that no rank owns (out of [0, V)) gives NaN instead of a silently wrong number.
        logp = torch.where(stats[2] == 1, logp, torch.full_like(logp, float("nan")))
        ctx.temperature = temperature
        ctx.with_entropy = with_entropy
        ctx.rows = rows
        ctx.set_materialize_grads(False)
        if with_entropy:
            entropy = log_sum - stats[3] / stats[0]
            ctx.save_for_backward(logits, safe_idx, owned, log_z, entropy)
            return logp, entropy
        ctx.save_for_backward(logits, safe_idx, owned, log_z)
        return logp

    @staticmethod
    def backward(ctx, *grad_outputs):
        if ctx.with_entropy:
            logits, safe_idx, owned, log_z, entropy = ctx.saved_tensors
            grad_logp, grad_ent = grad_outputs
        else:
            logits, safe_idx, owned, log_z = ctx.saved_tensors
            (grad_logp,), grad_ent = grad_outputs, None
        if not ctx.needs_input_grad[0] or (grad_logp is None and grad_ent is None):
            return None, None, None, None, None, None

        n_tokens, vocab_shard = logits.shape
        f32 = torch.float32
        temperature = ctx.temperature
        g_lp = grad_logp.to(f32) if grad_logp is not None else None
        g_h = grad_ent.to(f32) if grad_ent is not None else None
        # One-hot part of d logp / d z: +g_lp at the target column, only on the owning rank.
        if g_lp is not None:
            onehot_val = torch.where(owned, g_lp, torch.zeros_like(g_lp))

        grad = torch.empty_like(logits)
        rows = ctx.rows
        work = torch.empty(2, rows, vocab_shard, dtype=f32, device=logits.device)
        for start in range(0, n_tokens, rows):
            end = min(start + rows, n_tokens)
            r = end - start
            logp_all = _load_scaled(work[0, :r], logits[start:end], temperature)
            logp_all.sub_(log_z[start:end].unsqueeze(1))  # log p_j
            probs = torch.exp(logp_all, out=work[1, :r])  # p_j
            if g_h is not None:
                # dz_j = -p_j * (g_lp + g_h * (log p_j + H)) + g_lp * 1[j = y]
                coef = logp_all.add_(entropy[start:end].unsqueeze(1)).mul_(g_h[start:end].unsqueeze(1))
                if g_lp is not None:
                    coef.add_(g_lp[start:end].unsqueeze(1))
                dz = coef.mul_(probs).neg_()
            else:
                dz = torch.mul(probs, g_lp[start:end].unsqueeze(1), out=logp_all).neg_()
            if g_lp is not None:
                dz.scatter_add_(1, safe_idx[start:end].unsqueeze(1), onehot_val[start:end].unsqueeze(1))
            if temperature != 1.0:
                dz.div_(temperature)
            grad[start:end].copy_(dz)
        return grad, None, None, None, None, None


def vocab_parallel_logprobs(logits, targets, tp_group=None, temperature=1.0, with_entropy=False, chunk_size=None):
    """Log-prob of each target token (and optionally the entropy) from vocab-parallel logits.

    Args:
        logits: ``[..., V / TP]`` -- this rank's vocab shard (any dtype; fp32 math). Rank ``r`` of
            ``tp_group`` holds global vocab ids ``[r * V/TP, (r + 1) * V/TP)`` (Megatron's
            ``VocabUtility`` layout). Leading dims are flattened (a view when the layout allows,
            otherwise a copy: prefer contiguous logits and slice the *outputs* instead).
        targets: ``[...]`` global token ids in ``[0, V)``; the same tensor on every TP rank. Targets
            outside ``[0, V)`` give NaN log-probs -- put any valid id (e.g. 0) at positions you mask.
        tp_group: the tensor-parallel process group; ``None`` means the logits hold the full
            vocabulary (no communication).
        temperature: ``T > 0``; the distribution is ``softmax(logits / T)``.
        with_entropy: also return the entropy ``-sum_j p_j log p_j`` of that distribution.
        chunk_size: tokens per chunk; ``None`` picks ``CPU_CHUNK_ELEMENTS // (V / TP)`` on CPU and
            ``ACCEL_CHUNK_ELEMENTS // (V / TP)`` on other devices.

    Returns:
        ``logp`` (fp32, shape ``[...]``), or ``(logp, entropy)`` when ``with_entropy``. Both are
        differentiable w.r.t. ``logits``; gradients come back in the logits' dtype. The result is
        identical on every rank of ``tp_group``.
    """
    temperature = float(temperature)
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    lead = logits.shape[:-1]
    if tuple(targets.shape) != tuple(lead):
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match logits {tuple(logits.shape)}")
    flat_logits = logits.reshape(-1, logits.size(-1))
    flat_targets = targets.reshape(-1).long()
    if select_logprobs_kernel(flat_logits.device) == "triton":  # chunk_size does not apply there
        from mindspeed_llm.kernels.triton_logprobs import triton_vocab_parallel_logprobs

        out = triton_vocab_parallel_logprobs(flat_logits, flat_targets, tp_group, temperature, bool(with_entropy))
    else:
        out = _VocabParallelLogProbs.apply(
            flat_logits, flat_targets, tp_group, temperature, bool(with_entropy), chunk_size
        )
    if with_entropy:
        logp, entropy = out
        return logp.view(lead), entropy.view(lead)
    return out.view(lead)


def reference_logprobs(full_logits, targets, temperature=1.0, with_entropy=False):
    """Plain implementation on the full-vocabulary logits (ground truth / naive baseline).

    ``z = float32(full_logits) / T``; ``logp = log_softmax(z)[target]``;
    ``entropy = -sum_j exp(log_softmax(z)_j) * log_softmax(z)_j``. Materialises fp32 ``[..., V]``
    tensors (the upcast, the log-softmax and, for entropy, the softmax and a product).
    """
    z = full_logits.float()
    if temperature != 1.0:
        z = z / temperature
    log_probs = torch.log_softmax(z, dim=-1)
    logp = log_probs.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy
