"""Triton kernels for the clipped policy loss and the clipped value loss of ``core_algos.losses``: forward, gradient
and every metric in ONE launch over ``[B, T]``, fp32 arithmetic.

Same contract and math as :func:`mindspeed_llm.rl.core_algos.losses.policy_loss` (surrogates ``vanilla`` and
``gspo``, the dual clip, the rollout correction ``tis`` / ``mis``, the KL term of every ``KL_KINDS`` estimator, the
entropy bonus) and :func:`~mindspeed_llm.rl.core_algos.losses.value_loss`; ``core_algos`` is the reference and
chooses this path (``mindspeed_llm.kernels.select_kernel``). What differs is how the work runs:

* one task per (row, block of ``BLOCK_T`` positions), the programs looping over the tasks (one each on CUDA, a
  vector core's share on an NPU: ``kernels/launch.py``): a task reads each input once, computes the per-token loss
  terms, their metrics' partial sums (one row of ``[tasks, metrics]`` fp32, summed afterwards in torch: no
  atomics, the same result on every run) and the loss's gradient with respect to the log-probs (values) and the
  entropy, which it stores (fp32 ``[B, T]``, only when that input needs a gradient). The loss is a sum of per-token
  terms, so its gradient is known in the forward: the backward is one multiply by the incoming scalar gradient,
  with no second pass over the inputs and no saved intermediates besides that gradient.
* the aggregation (``--loss-agg-mode``) enters as the per-row denominators of ``aggregation_weights``
  (``w = m / denominator``); the token means' denominator is one number. Both are read from device tensors (the
  batch totals of a split batch), so nothing waits for the host.
* the gradients follow torch's conventions where the loss has a kink: ``max(x, y)`` sends half the gradient to
  each side on a tie (``l1 == l2`` whenever the clip is inactive), ``clamp`` passes the gradient on its closed
  range ``[lo, hi]``, ``|x|`` has gradient ``sign(x)``; so the gradients equal autograd's on the torch path, not
  only almost everywhere.
* GSPO: its sequence ratio (a detached row mean, ``[B]``) is computed in torch first and read per row.

Inputs are read in their dtypes (bool masks as bytes), results are cast to the torch path's dtypes (the log-probs'
for the loss and metrics; the gradients come back in each input's dtype). Importing this module imports Triton
and defines the kernels; ``TRITON_INTERPRET=1`` before the import runs them on CPU tensors
(tests/dist/test_triton_rl_math.py). ``BLOCK_T`` and the warp count are untuned defaults: no GPU was available when this
was written. On Ascend (Triton-Ascend) the kernels have never run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mindspeed_llm.kernels.launch import launch, vector_cores

__all__ = ["fused_policy_loss", "fused_value_loss", "POLICY_METRICS", "VALUE_METRICS", "BLOCK_T"]

BLOCK_T = 1024
# float32-sized tiles a block keeps live (inputs, ratios, surrogates, gradients; the value kernel fewer): size the tile
# to the NPU's unified buffer (kernels/launch.py; estimates, unverified until compiled by Triton-Ascend)
POLICY_LIVE_TILES = 32
VALUE_LIVE_TILES = 16

# Order of the policy kernel's partial sums. The first three are the loss's parts (pg, KL, entropy token mean).
POLICY_METRICS = ("pg_loss", "kl_loss", "entropy", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "approx_kl",
                  "ppo_ratio", "ppo_ratio_clamped", "abs_pg_loss", "kl", "rollout_is_weight", "rollout_is_clipfrac")
VALUE_METRICS = ("vf_max_sum", "vf_clipfrac", "vpred", "returns")
_KL_CODES = {"k1": 1, "k2": 2, "k3": 3, "low_var_kl": 3, "abs": 4}
_IS_CODES = {"none": 0, "tis": 1, "mis": 2}


@triton.jit
def _max_grad(x, y, dx, dy):
    # d max(x, y): torch's rule, half to each side on a tie
    return tl.where(x > y, dx, tl.where(y > x, dy, 0.5 * (dx + dy)))


@triton.jit
def _policy_loss_kernel(
    logp_ptr, old_ptr, adv_ptr, mask_ptr, ref_ptr, ent_ptr, rollout_ptr, seq_ptr, loss_den_ptr, tok_den_ptr,
    grad_logp_ptr, grad_ent_ptr, partial_ptr,
    s_logp, s_old, s_adv_row, s_adv_col, s_mask, s_ref, s_ent, s_rollout, s_grad, s_grad_ent,
    length, n_blocks, n_tasks, lo, hi, dual_clip, kl_coef, entropy_coeff, is_threshold,
    SEQUENCE_RATIO: tl.constexpr, DUAL: tl.constexpr, KL: tl.constexpr, ENTROPY: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr, IS: tl.constexpr, LOGP_GRAD: tl.constexpr, N_METRICS: tl.constexpr,
    BLOCK_T: tl.constexpr, K3_LOG_RATIO_BOUND: tl.constexpr, K3_VALUE_BOUND: tl.constexpr,
):
    # programs loop over the (row, block) tasks (kernels/launch.py: one each on CUDA, a core's share on NPU)
    for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        row = tl.cast(task // n_blocks, tl.int64)
        cols = (task % n_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
        inside = cols < length
        out = partial_ptr + task * N_METRICS

        m = tl.load(mask_ptr + row * s_mask + cols, mask=inside, other=0).to(tl.float32)
        loss_w = m / tl.load(loss_den_ptr + row)
        tok_w = m / tl.load(tok_den_ptr)
        lp = tl.load(logp_ptr + row * s_logp + cols, mask=inside, other=0.0).to(tl.float32)
        old = tl.load(old_ptr + row * s_old + cols, mask=inside, other=0.0).to(tl.float32)
        adv = tl.load(adv_ptr + row * s_adv_row + cols * s_adv_col, mask=inside, other=0.0).to(tl.float32)
        log_ratio = lp - old
        if SEQUENCE_RATIO:  # GSPO: value exp(s_i), gradient exp(s_i) * d logp (as for the token ratio)
            ratio = tl.exp(tl.load(seq_ptr + row) + tl.zeros_like(lp))
        else:
            ratio = tl.exp(log_ratio)
        ratio_clamped = tl.minimum(tl.maximum(ratio, lo), hi)
        l1 = -adv * ratio
        l2 = -adv * ratio_clamped
        pg = tl.maximum(l1, l2)
        d_pg = _max_grad(l1, l2, -adv, tl.where((ratio >= lo) & (ratio <= hi), -adv, 0.0))  # d pg / d ratio
        clipped = (l2 > l1).to(tl.float32)
        abs_pg = tl.maximum(tl.abs(l1), tl.abs(l2))
        dual_active = tl.zeros_like(lp)
        if DUAL:
            l3 = -adv * dual_clip
            active = (adv < 0) & (pg > l3)
            pg = tl.where(active, l3, pg)
            d_pg = tl.where(active, 0.0, d_pg)
            dual_active = active.to(tl.float32)
        if IS != 0:
            rollout = tl.load(rollout_ptr + row * s_rollout + cols, mask=inside, other=0.0).to(tl.float32)
            w = tl.exp(old - rollout)
            if IS == 1:
                is_w = tl.minimum(w, is_threshold)
            else:
                is_w = tl.where(w <= is_threshold, w, 0.0)
            pg = pg * is_w
            d_pg = d_pg * is_w
            tl.store(out + 11, tl.sum(is_w * tok_w, axis=0))
            tl.store(out + 12, tl.sum((w > is_threshold).to(tl.float32) * tok_w, axis=0))
        else:
            tl.store(out + 11, 0.0)
            tl.store(out + 12, 0.0)
        grad = d_pg * ratio * loss_w
        tl.store(out + 0, tl.sum(pg * loss_w, axis=0))

        if KL != 0:
            ref = tl.load(ref_ptr + row * s_ref + cols, mask=inside, other=0.0).to(tl.float32)
            if KL == 1:
                kl = lp - ref
                d_kl = tl.full((BLOCK_T,), 1.0, tl.float32)
            elif KL == 2:
                diff = ref - lp
                kl = 0.5 * diff * diff
                d_kl = -diff
            elif KL == 3:
                log_r = ref - lp
                log_r_c = tl.minimum(tl.maximum(log_r, -K3_LOG_RATIO_BOUND), K3_LOG_RATIO_BOUND)
                e = tl.exp(log_r_c)
                est = e - log_r_c - 1.0
                kl = tl.minimum(tl.maximum(est, -K3_VALUE_BOUND), K3_VALUE_BOUND)
                passes = ((log_r >= -K3_LOG_RATIO_BOUND) & (log_r <= K3_LOG_RATIO_BOUND)
                          & (est >= -K3_VALUE_BOUND) & (est <= K3_VALUE_BOUND))
                d_kl = tl.where(passes, 1.0 - e, 0.0)
            else:
                diff = lp - ref
                kl = tl.abs(diff)
                d_kl = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
            grad = grad + kl_coef * (d_kl * loss_w)
            tl.store(out + 1, tl.sum(kl * loss_w, axis=0))
            tl.store(out + 10, tl.sum(kl * tok_w, axis=0))
        else:
            tl.store(out + 1, 0.0)
            tl.store(out + 10, 0.0)

        if ENTROPY:
            ent = tl.load(ent_ptr + row * s_ent + cols, mask=inside, other=0.0).to(tl.float32)
            tl.store(out + 2, tl.sum(ent * tok_w, axis=0))
            if ENTROPY_GRAD:
                tl.store(grad_ent_ptr + row * s_grad_ent + cols, -entropy_coeff * tok_w, mask=inside)
        else:
            tl.store(out + 2, 0.0)

        tl.store(out + 3, tl.sum(clipped * tok_w, axis=0))
        tl.store(out + 4, tl.sum(dual_active * tok_w, axis=0))
        tl.store(out + 5, tl.sum(-log_ratio * tok_w, axis=0))
        tl.store(out + 6, tl.sum(0.5 * log_ratio * log_ratio * tok_w, axis=0))
        tl.store(out + 7, tl.sum(ratio * tok_w, axis=0))
        tl.store(out + 8, tl.sum(ratio_clamped * tok_w, axis=0))
        tl.store(out + 9, tl.sum(abs_pg * tok_w, axis=0))
        if LOGP_GRAD:
            tl.store(grad_logp_ptr + row * s_grad + cols, grad, mask=inside)


@triton.jit
def _value_loss_kernel(
    values_ptr, old_ptr, returns_ptr, mask_ptr, tok_den_ptr, grad_ptr, partial_ptr,
    s_values, s_old, s_returns, s_mask, s_grad, length, n_blocks, n_tasks, cliprange,
    VALUE_GRAD: tl.constexpr, N_METRICS: tl.constexpr, BLOCK_T: tl.constexpr,
):
    # programs loop over the (row, block) tasks (kernels/launch.py: one each on CUDA, a core's share on NPU)
    for task in range(tl.program_id(0), n_tasks, tl.num_programs(0)):
        row = tl.cast(task // n_blocks, tl.int64)
        cols = (task % n_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
        inside = cols < length
        out = partial_ptr + task * N_METRICS
        tok_w = tl.load(mask_ptr + row * s_mask + cols, mask=inside, other=0).to(tl.float32) / tl.load(tok_den_ptr)
        v = tl.load(values_ptr + row * s_values + cols, mask=inside, other=0.0).to(tl.float32)
        old = tl.load(old_ptr + row * s_old + cols, mask=inside, other=0.0).to(tl.float32)
        ret = tl.load(returns_ptr + row * s_returns + cols, mask=inside, other=0.0).to(tl.float32)
        lo = old - cliprange
        hi = old + cliprange
        v_clip = tl.minimum(tl.maximum(v, lo), hi)
        e1 = v - ret
        e2 = v_clip - ret
        vf1 = e1 * e1
        vf2 = e2 * e2
        tl.store(out + 0, tl.sum(tl.maximum(vf1, vf2) * tok_w, axis=0))
        tl.store(out + 1, tl.sum((vf2 > vf1).to(tl.float32) * tok_w, axis=0))
        tl.store(out + 2, tl.sum(v * tok_w, axis=0))
        tl.store(out + 3, tl.sum(ret * tok_w, axis=0))
        if VALUE_GRAD:
            d = _max_grad(vf1, vf2, 2.0 * e1, tl.where((v >= lo) & (v <= hi), 2.0 * e2, 0.0))
            tl.store(grad_ptr + row * s_grad + cols, 0.5 * d * tok_w, mask=inside)


def _rows(x):
    """``x`` with unit stride along T (a copy only when it has not); bool read as bytes (no copy)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.view(torch.uint8) if x.dtype == torch.bool else x


def _launch_for(device, batch: int, length: int, live_tiles: int, programs):
    """(programs, tile, blocks per row, tasks) of a loss kernel (kernels/launch.py); `programs` overrides the grid
    (tests: programs that loop over several tasks, as on an NPU)."""
    block = launch(1, length, BLOCK_T, live_tiles, device.type, vector_cores(device)).block
    n_blocks = triton.cdiv(length, block) if length else 0
    tasks = batch * n_blocks
    plan = launch(tasks, length, BLOCK_T, live_tiles, device.type, vector_cores(device))
    return (min(int(programs), tasks) if programs else plan.programs), block, n_blocks, tasks


def _per_row(denominator, batch, device):
    """A denominator broadcastable to ``[B, 1]`` as ``[B]`` fp32 (a 0-d one is expanded, not copied per row)."""
    d = torch.as_tensor(denominator, device=device).to(torch.float32)
    return d.reshape(-1).expand(batch).contiguous() if d.numel() == 1 else d.reshape(batch).contiguous()


class _FusedPolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, entropy, old_logp, advantages, mask, ref_logp, rollout_logp, seq_log_ratio, loss_den,
                tok_den, params):
        (lo, hi, dual_clip, kl_code, kl_coef, entropy_coeff, is_code, is_threshold, k3_bounds, programs) = params
        batch, length = logp.shape
        device = logp.device
        grid, block, n_blocks, tasks = _launch_for(device, batch, length, POLICY_LIVE_TILES, programs)
        n = len(POLICY_METRICS)
        partial = torch.zeros((batch * n_blocks, n), dtype=torch.float32, device=device)
        logp_grad = ctx.needs_input_grad[0]
        entropy_grad = entropy is not None and ctx.needs_input_grad[1] and entropy_coeff != 0.0
        grad_logp = torch.empty((batch, length), dtype=torch.float32, device=device) if logp_grad else None
        grad_ent = torch.empty((batch, length), dtype=torch.float32, device=device) if entropy_grad else None
        lp, old, m = _rows(logp), _rows(old_logp), _rows(mask)
        ref = _rows(ref_logp) if ref_logp is not None else lp
        ent = _rows(entropy) if entropy is not None else lp
        rollout = _rows(rollout_logp) if rollout_logp is not None else lp
        seq = seq_log_ratio if seq_log_ratio is not None else loss_den  # placeholder pointers when unused
        g_lp = grad_logp if grad_logp is not None else partial
        g_ent = grad_ent if grad_ent is not None else partial
        if batch and n_blocks:
            _policy_loss_kernel[(grid,)](
                lp, old, advantages, m, ref, ent, rollout, seq, loss_den, tok_den, g_lp, g_ent, partial,
                lp.stride(0), old.stride(0), advantages.stride(0), advantages.stride(1), m.stride(0), ref.stride(0),
                ent.stride(0), rollout.stride(0), length if logp_grad else 0, length if entropy_grad else 0,
                length, n_blocks, tasks, lo, hi, dual_clip if dual_clip is not None else 0.0, kl_coef, entropy_coeff,
                is_threshold,
                SEQUENCE_RATIO=seq_log_ratio is not None, DUAL=dual_clip is not None, KL=kl_code,
                ENTROPY=entropy is not None, ENTROPY_GRAD=entropy_grad, IS=is_code, LOGP_GRAD=logp_grad,
                N_METRICS=n, BLOCK_T=block, K3_LOG_RATIO_BOUND=k3_bounds[0], K3_VALUE_BOUND=k3_bounds[1],
                num_warps=4,
            )
        sums = partial.sum(dim=0)
        loss = sums[0]
        if kl_code:
            loss = loss + kl_coef * sums[1]
        if entropy is not None and entropy_coeff != 0.0:
            loss = loss - entropy_coeff * sums[2]
        ctx.save_for_backward(grad_logp, grad_ent)
        ctx.dtypes = (logp.dtype, entropy.dtype if entropy is not None else None)
        ctx.mark_non_differentiable(sums)
        return loss.to(logp.dtype), sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_sums):
        grad_logp, grad_ent = ctx.saved_tensors
        g = grad_loss.to(torch.float32)
        d_logp = (grad_logp * g).to(ctx.dtypes[0]) if grad_logp is not None else None
        d_ent = (grad_ent * g).to(ctx.dtypes[1]) if grad_ent is not None else None
        return (d_logp, d_ent) + (None,) * 9


def fused_policy_loss(logp, old_logp, advantages, mask, loss_denominator, token_denominator, *, clip_low, clip_high,
                      dual_clip=None, sequence_log_ratio=None, ref_logp=None, kl_coef=0.0, kl_kind="k1",
                      entropy=None, entropy_coeff=0.0, rollout_logp=None, rollout_is="none",
                      rollout_is_threshold=2.0, k3_bounds=None, programs=None):
    """``core_algos.policy_loss`` on ``[B, T]`` inputs, fused. ``advantages`` ``[B, T]`` or ``[B, 1]``;
    ``loss_denominator`` / ``token_denominator``: ``core_algos.aggregation_denominator`` of the loss's mode and of
    ``token-mean``; ``sequence_log_ratio`` ``[B]``: GSPO's detached row mean of ``logp - old_logp`` (None: the token
    ratio). ``ref_logp`` / ``kl_coef`` / ``kl_kind``: the KL term when ``kl_coef != 0``; ``k3_bounds``: the
    k3 / low_var_kl clamps (log-ratio, estimate) of ``core_algos.kl``, which the caller passes (this layer imports
    nothing above it); ``programs`` overrides the grid (tests, `_launch_for`). Returns ``(loss, metrics)`` with
    ``core_algos.policy_loss``'s keys."""
    batch, length = logp.shape
    device = logp.device
    if advantages.shape[-1] == 1 and length != 1:
        advantages = advantages.expand(batch, length)  # stride 0 along T: read once per row from cache
    kl_code = _KL_CODES[kl_kind] if kl_coef != 0.0 else 0
    if kl_code == _KL_CODES["k3"] and k3_bounds is None:
        raise ValueError("fused_policy_loss: kl_kind k3 / low_var_kl needs k3_bounds (core_algos.kl's clamps)")
    k3_bounds = (0.0, 0.0) if k3_bounds is None else k3_bounds  # unused by the other estimators
    params = (1.0 - clip_low, 1.0 + clip_high, dual_clip, kl_code, float(kl_coef), float(entropy_coeff),
              _IS_CODES[rollout_is], float(rollout_is_threshold), tuple(float(b) for b in k3_bounds), programs)
    seq = sequence_log_ratio.detach().to(torch.float32).contiguous() if sequence_log_ratio is not None else None
    loss, sums = _FusedPolicyLoss.apply(
        logp, entropy, old_logp.detach(), advantages.detach(), mask, ref_logp.detach() if kl_code else None,
        rollout_logp.detach() if rollout_is != "none" else None, seq,
        _per_row(loss_denominator, batch, device), _per_row(token_denominator, 1, device), params,
    )
    sums = sums.to(logp.dtype)
    metrics = {k: sums[POLICY_METRICS.index(k)] for k in (
        "pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "approx_kl", "ppo_ratio", "ppo_ratio_clamped",
        "abs_pg_loss")}
    if rollout_is != "none":
        metrics["rollout_is_weight"] = sums[POLICY_METRICS.index("rollout_is_weight")]
        metrics["rollout_is_clipfrac"] = sums[POLICY_METRICS.index("rollout_is_clipfrac")]
    if kl_code:
        metrics["kl_loss"] = sums[POLICY_METRICS.index("kl_loss")]
        metrics["kl"] = sums[POLICY_METRICS.index("kl")]
    if entropy is not None:
        metrics["entropy"] = sums[POLICY_METRICS.index("entropy")]
    metrics["loss"] = loss.detach()
    return loss, metrics


class _FusedValueLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, old_values, returns, mask, tok_den, cliprange, programs):
        batch, length = values.shape
        device = values.device
        grid, block, n_blocks, tasks = _launch_for(device, batch, length, VALUE_LIVE_TILES, programs)
        n = len(VALUE_METRICS)
        partial = torch.zeros((batch * n_blocks, n), dtype=torch.float32, device=device)
        value_grad = ctx.needs_input_grad[0]
        grad = torch.empty((batch, length), dtype=torch.float32, device=device) if value_grad else None
        v, old, ret, m = _rows(values), _rows(old_values), _rows(returns), _rows(mask)
        if batch and n_blocks:
            _value_loss_kernel[(grid,)](
                v, old, ret, m, tok_den, grad if grad is not None else partial, partial,
                v.stride(0), old.stride(0), ret.stride(0), m.stride(0), length if value_grad else 0, length,
                n_blocks, tasks, cliprange, VALUE_GRAD=value_grad, N_METRICS=n, BLOCK_T=block, num_warps=4,
            )
        sums = partial.sum(dim=0)
        ctx.save_for_backward(grad)
        ctx.dtype = values.dtype
        ctx.mark_non_differentiable(sums)
        return (0.5 * sums[0]).to(values.dtype), sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_sums):
        (grad,) = ctx.saved_tensors
        d = (grad * grad_loss.to(torch.float32)).to(ctx.dtype) if grad is not None else None
        return d, None, None, None, None, None, None


def fused_value_loss(values, old_values, returns, value_mask, cliprange_value, token_denominator, programs=None):
    """``core_algos.value_loss`` on ``[B, T]`` inputs, fused; ``token_denominator`` is
    ``core_algos.aggregation_denominator(value_mask, "token-mean", total_tokens=...)``. Returns
    ``(loss, metrics)`` with ``value_loss``'s keys."""
    loss, sums = _FusedValueLoss.apply(values, old_values.detach(), returns.detach(), value_mask,
                                       _per_row(token_denominator, 1, values.device), float(cliprange_value),
                                       programs)
    sums = sums.to(values.dtype)
    return loss, {"vf_loss": loss.detach(), "vf_clipfrac": sums[1], "vpred": sums[2], "returns": sums[3]}
