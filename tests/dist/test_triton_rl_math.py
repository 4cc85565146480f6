"""The Triton kernels of the RL math on CPU, under Triton's interpreter: the scans
(mindspeed_llm.kernels.triton_scans) against the torch scans of core_algos.scans and the per-position loops, and the
fused policy / value losses (mindspeed_llm.kernels.triton_rl_losses) against core_algos' torch losses (values,
every metric and the gradients), in fp32 and with bf16 inputs; the dispatch from core_algos (MINDSPEED_SCAN_KERNEL /
MINDSPEED_LOSS_KERNEL=triton); and the real kernels compiled by Triton down to an sm_90 cubin (no GPU needed).

As in tests/dist/test_triton_logprobs.py, ``TRITON_INTERPRET=1`` must be set before the kernels are defined, so the
interpreted checks run in a child process (this file run as a script, ``python tests/dist/test_triton_rl_math.py
CHECK``).

Tolerances. fp32: the same arithmetic in another order (a scan tree / block sums instead of a chain / torch's
reduction), so 1e-5 relative to the sizes involved. bf16 inputs: the kernels read bf16 and compute in fp32; they
are compared with the torch path on the same values upcast to fp32 (fp32 tolerance; the stored bf16 results and
gradients at one bf16 unit, 2**-7 relative) and, loosely, with the torch path run in bf16 itself.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (requirements-test.txt: pip install -c constraints.txt triton==3.9.0; "
    "the CPU wheel runs these checks under TRITON_INTERPRET=1)",
)

BF16_RTOL = 2.0 ** -7


@contextlib.contextmanager
def _env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name)
        else:
            os.environ[name] = old


def _scan_case(batch, length, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=g)
    values = torch.randn(batch, length, generator=g)
    mask = torch.rand(batch, length, generator=g) > 0.2  # interior holes
    if batch > 1:
        mask[1, length // 2:] = False
    return rewards.to(dtype), values.to(dtype), mask


# ----------------------------------------------------------------------------------------------------
# Checks run in the child process (TRITON_INTERPRET=1).


def check_scans():
    from mindspeed_llm.kernels import triton_scans as ts
    from mindspeed_llm.rl import core_algos as ca
    from mindspeed_llm.rl.core_algos import scans

    n = 0
    for length, block in ((1, None), (13, None), (37, 16), (64, 16), (100, 32)):
        for gamma, lam in ((1.0, 1.0), (0.99, 0.95), (0.9, 0.0)):
            rewards, values, mask = _scan_case(3, length, 10 * length + int(100 * lam))
            case = f"T={length} block={block} gamma={gamma} lam={lam}"
            adv, ret = ts.triton_gae(rewards, values, mask, gamma, lam, block_t=block)
            ref_adv, ref_ret = scans.gae_scan(rewards, values, mask, gamma, lam, kernel="torch")
            loop_adv, loop_ret = scans.gae_scan_loop(rewards, values, mask, gamma, lam)
            for got, want, what in ((adv, ref_adv, "advantages vs torch scan"), (adv, loop_adv, "advantages vs loop"),
                                    (ret, ref_ret, "returns vs torch scan"), (ret, loop_ret, "returns vs loop")):
                assert got.dtype == torch.float32, case
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{case}: {what}: {m}")
            # A float value mask (weights) and a float response mask.
            weights = mask.float() * 0.5
            adv, _ = ts.triton_gae(rewards, values, weights, gamma, lam, block_t=block)
            torch.testing.assert_close(adv, scans.gae_scan_loop(rewards, values, weights, gamma, lam)[0],
                                       rtol=1e-5, atol=1e-5)
            got = ts.triton_discounted_returns(rewards, mask, gamma, block_t=block)
            torch.testing.assert_close(got, scans.discounted_returns(rewards, mask, gamma, kernel="torch"),
                                       rtol=1e-5, atol=1e-5, msg=lambda m: f"{case}: returns vs torch scan: {m}")
            torch.testing.assert_close(got, scans.discounted_returns_loop(rewards, mask, gamma),
                                       rtol=1e-5, atol=1e-5, msg=lambda m: f"{case}: returns vs loop: {m}")
            n += 1
    # bf16 inputs: fp32 arithmetic, bf16 results (one rounding of the fp32 result).
    rewards, values, mask = _scan_case(2, 37, 5, torch.bfloat16)
    adv, ret = ts.triton_gae(rewards, values, mask, 0.99, 0.95, block_t=16)
    assert adv.dtype == ret.dtype == torch.bfloat16
    ref_adv, ref_ret = scans.gae_scan_loop(rewards.float(), values.float(), mask, 0.99, 0.95)
    torch.testing.assert_close(adv.float(), ref_adv, rtol=BF16_RTOL, atol=1e-6)
    torch.testing.assert_close(ret.float(), ref_ret, rtol=BF16_RTOL, atol=1e-6)
    got = ts.triton_discounted_returns(rewards, mask, 0.97, block_t=16)
    torch.testing.assert_close(got.float(), scans.discounted_returns_loop(rewards.float(), mask, 0.97),
                               rtol=BF16_RTOL, atol=1e-6)
    # Strided rows (a column slice of wider tensors) are read in place; empty batches / rows.
    wide_r, wide_v, wide_m = _scan_case(3, 50, 6)
    adv, _ = ts.triton_gae(wide_r[:, :40], wide_v[:, :40], wide_m[:, :40], 1.0, 0.9, block_t=16)
    torch.testing.assert_close(adv, scans.gae_scan_loop(wide_r[:, :40], wide_v[:, :40], wide_m[:, :40], 1.0, 0.9)[0],
                               rtol=1e-5, atol=1e-5)
    # Fewer programs than rows, each looping over its share (the NPU's launch, kernels/launch.py): the same results.
    rewards, values, mask = _scan_case(5, 37, 7)
    for programs in (1, 2):
        adv, ret = ts.triton_gae(rewards, values, mask, 0.99, 0.95, block_t=16, programs=programs)
        ref_adv, ref_ret = ts.triton_gae(rewards, values, mask, 0.99, 0.95, block_t=16)
        assert torch.equal(adv, ref_adv) and torch.equal(ret, ref_ret), programs
        assert torch.equal(ts.triton_discounted_returns(rewards, mask, 0.97, block_t=16, programs=programs),
                           ts.triton_discounted_returns(rewards, mask, 0.97, block_t=16)), programs
    assert ts.triton_gae(*_scan_case(0, 5, 1), 1.0, 1.0)[0].shape == (0, 5)
    assert ts.triton_discounted_returns(torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.bool), 1.0).shape == (2, 0)

    # Through the estimators the stages call, with MINDSPEED_SCAN_KERNEL=triton: the kernels run.
    calls = []
    real_gae, real_returns = ts.triton_gae, ts.triton_discounted_returns
    ts.triton_gae = lambda *a, **k: calls.append("gae") or real_gae(*a, **k)
    ts.triton_discounted_returns = lambda *a, **k: calls.append("returns") or real_returns(*a, **k)
    try:
        rewards, values, mask = _scan_case(3, 30, 8)
        with _env("MINDSPEED_SCAN_KERNEL", "triton"):
            adv, ret = ca.compute_gae(rewards, values, mask, 1.0, 0.95)
            rpp = ca.reinforce_plus_plus_advantages(rewards, mask, gamma=0.9)
            values_grad = values.clone().requires_grad_()
            ca.compute_gae(rewards, values_grad, mask, 1.0, 0.95)  # needs a gradient: the torch path
        with _env("MINDSPEED_SCAN_KERNEL", "torch"):
            ref_adv, ref_ret = ca.compute_gae(rewards, values, mask, 1.0, 0.95)
            ref_rpp = ca.reinforce_plus_plus_advantages(rewards, mask, gamma=0.9)
    finally:
        ts.triton_gae, ts.triton_discounted_returns = real_gae, real_returns
    assert calls == ["gae", "returns"], calls
    torch.testing.assert_close(adv, ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rpp, ref_rpp, rtol=1e-5, atol=1e-5)
    print(f"{n} scan cases ok")


def _loss_inputs(batch, length, seed):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(batch, length, generator=g) * 3
    old = logp + torch.randn(batch, length, generator=g) * 0.3
    old[0] = logp[0]  # ratio exactly 1: the clip's inside, l1 == l2 (the max's tie)
    adv = torch.randn(batch, length, generator=g)
    adv[1, :3] = 0.0
    mask = torch.rand(batch, length, generator=g) > 0.25
    mask[-1] = False  # an empty row
    ref = logp + torch.randn(batch, length, generator=g) * 0.6
    ref[1, :4] = logp[1, :4] + torch.tensor([25.0, -25.0, 3.0, -12.0])  # k3's clamps
    entropy = torch.rand(batch, length, generator=g) * 2
    rollout = old + torch.randn(batch, length, generator=g) * 0.5
    return logp, old, adv, mask, ref, entropy, rollout


def _policy(kernel, dtype, logp, old, adv, mask, ref, entropy, rollout, kw):
    x = logp.detach().to(dtype).clone().requires_grad_()
    e = entropy.detach().to(dtype).clone().requires_grad_()
    with _env("MINDSPEED_LOSS_KERNEL", kernel):
        from mindspeed_llm.rl import core_algos as ca

        loss, metrics = ca.policy_loss(x, old.to(dtype), adv.to(dtype), mask, ref_logp=ref.to(dtype), entropy=e,
                                       rollout_logp=rollout.to(dtype), **kw)
    (loss * 1.7).backward()
    return loss.detach(), metrics, x.grad, e.grad


POLICY_CASES = [
    dict(),
    dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0),
    dict(agg="seq-mean-token-mean", kl_coef=0.05, kl_kind="k3", entropy_coeff=0.01),
    dict(agg="seq-mean-token-sum", kl_coef=0.1, kl_kind="k1", rollout_is="tis", rollout_is_threshold=1.5),
    dict(agg="seq-mean-token-sum-norm", max_len=48, kl_coef=0.1, kl_kind="k2", rollout_is="mis"),
    dict(kl_coef=0.2, kl_kind="abs", entropy_coeff=-0.02, dual_clip=2.0),
    dict(kl_coef=0.1, kl_kind="low_var_kl", total_tokens=torch.tensor(90.0), total_sequences=torch.tensor(9.0),
         agg="seq-mean-token-mean"),
    dict(loss_type="gspo", clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean", kl_coef=0.05, kl_kind="k3"),
    dict(loss_type="gspo", clip_low=0.1, agg="token-mean", rollout_is="tis", entropy_coeff=0.01),
    dict(clip_low=0.0, clip_high=0.0),  # lo == hi == 1: the ratio-1 row sits on both clamp bounds
]


def check_losses():
    import mindspeed_llm.kernels.triton_rl_losses as fused

    calls = []
    real_policy, real_value = fused.fused_policy_loss, fused.fused_value_loss
    fused.fused_policy_loss = lambda *a, **k: calls.append("policy") or real_policy(*a, **k)
    fused.fused_value_loss = lambda *a, **k: calls.append("value") or real_value(*a, **k)
    try:
        _check_losses(calls)
    finally:
        fused.fused_policy_loss, fused.fused_value_loss = real_policy, real_value


def _check_losses(calls):
    from mindspeed_llm.rl import core_algos as ca

    n = 0
    for length in (37, 1030):  # one masked block / two blocks of 1024
        inputs = _loss_inputs(5, length, length)
        for kw in POLICY_CASES:
            for adv_shape in ("token", "row", "flat") if length < 100 else ("token",):  # two blocks: one shape
                logp, old, adv, mask, ref, entropy, rollout = inputs
                adv = {"token": adv, "row": adv[:, :1], "flat": adv[:, 0]}[adv_shape]
                case = f"T={length} {kw} advantages {adv_shape}"
                calls.clear()
                got = _policy("triton", torch.float32, logp, old, adv, mask, ref, entropy, rollout, kw)
                assert calls == ["policy"], (case, calls)
                want = _policy("torch", torch.float32, logp, old, adv, mask, ref, entropy, rollout, kw)
                assert set(got[1]) == set(want[1]), (case, set(got[1]) ^ set(want[1]))
                torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6, msg=lambda m: f"{case}: loss: {m}")
                for k in want[1]:
                    torch.testing.assert_close(got[1][k], want[1][k], rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"{case}: metric {k}: {m}")
                torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"{case}: d loss / d logp: {m}")
                assert (got[3] is None) == (want[3] is None), case
                if want[3] is not None:
                    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=1e-7,
                                               msg=lambda m: f"{case}: d loss / d entropy: {m}")
                n += 1
                if adv_shape != "token" or length > 100:
                    continue
                # bf16 inputs: against the torch path on the same (upcast) values, and loosely against torch in bf16.
                rounded = [t.to(torch.bfloat16).float() for t in (logp, old, adv, ref, entropy, rollout)]
                b = _policy("triton", torch.bfloat16, logp, old, adv, mask, ref, entropy, rollout, kw)
                f = _policy("torch", torch.float32, rounded[0], rounded[1], rounded[2], mask, rounded[3], rounded[4],
                            rounded[5], kw)
                t16 = _policy("torch", torch.bfloat16, logp, old, adv, mask, ref, entropy, rollout, kw)
                assert b[0].dtype == torch.bfloat16 and b[2].dtype == torch.bfloat16, case
                torch.testing.assert_close(b[0].float(), f[0], rtol=BF16_RTOL, atol=1e-5)
                for k in f[1]:
                    torch.testing.assert_close(b[1][k].float(), f[1][k], rtol=BF16_RTOL, atol=1e-5,
                                               msg=lambda m: f"{case} bf16: metric {k}: {m}")
                torch.testing.assert_close(b[2].float(), f[2], rtol=BF16_RTOL, atol=1e-7,
                                           msg=lambda m: f"{case} bf16: d loss / d logp: {m}")
                torch.testing.assert_close(b[0].float(), t16[0].float(), rtol=0.05, atol=0.02)
    # A surrogate registered elsewhere, or tensors that are not [B, T], take the torch path.
    logp, old, adv, mask, ref, entropy, rollout = _loss_inputs(3, 9, 0)
    calls.clear()
    with _env("MINDSPEED_LOSS_KERNEL", "triton"):
        ca.policy_loss(logp[0], old[0], adv[0], mask[0])  # 1-D
    assert calls == [], calls

    # Value loss: clip active / inactive / exactly on its bounds (the max's tie), totals, bf16.
    g = torch.Generator().manual_seed(3)
    for length in (37, 1030):
        old_v = torch.randn(4, length, generator=g)
        values = old_v + torch.randn(4, length, generator=g) * 0.3
        values[0, :6] = old_v[0, :6] + 0.2  # on the upper bound
        values[1, :6] = old_v[1, :6] - 0.2  # on the lower bound
        returns = torch.randn(4, length, generator=g)
        returns[2, :4] = values[2, :4]
        vmask = torch.rand(4, length, generator=g) > 0.2
        for total in (None, torch.tensor(50.0)):
            for dtype in (torch.float32, torch.bfloat16):
                case = f"value loss T={length} total={total} {dtype}"
                rounded = [t.to(dtype) for t in (values, old_v, returns)]
                results = {}
                # The kernel on the dtype's values; the torch path on the same values in fp32 (and, for bf16, in bf16).
                variants = (("kernel", "triton", rounded), ("torch", "torch", [t.float() for t in rounded]),
                            ("torch in dtype", "torch", rounded))
                for name, kernel, inputs in variants:
                    x = inputs[0].clone().requires_grad_()
                    calls.clear()
                    with _env("MINDSPEED_LOSS_KERNEL", kernel):
                        loss, m = ca.value_loss(x, inputs[1], inputs[2], vmask, 0.2, total_tokens=total)
                    (2.0 * loss).backward()
                    assert calls == (["value"] if kernel == "triton" else []), (case, calls)
                    results[name] = (loss.detach(), m, x.grad)
                got, want = results["kernel"], results["torch"]
                assert got[0].dtype == got[2].dtype == dtype and set(got[1]) == set(want[1]), case
                rtol = 1e-5 if dtype == torch.float32 else BF16_RTOL
                torch.testing.assert_close(got[0].float(), want[0], rtol=rtol, atol=1e-6, msg=lambda m: f"{case}: {m}")
                for k in want[1]:
                    torch.testing.assert_close(got[1][k].float(), want[1][k], rtol=rtol, atol=1e-6,
                                               msg=lambda m: f"{case}: {k}: {m}")
                torch.testing.assert_close(got[2].float(), want[2], rtol=rtol, atol=1e-7,
                                           msg=lambda m: f"{case}: grad {m}")
                torch.testing.assert_close(got[0].float(), results["torch in dtype"][0].float(), rtol=0.05, atol=0.02)
                n += 1
    # Fewer programs than (row, block) tasks, each looping over its share (the NPU's launch, kernels/launch.py): the
    # same sums and gradients, bit for bit (each task computes alike, whichever program runs it).
    import mindspeed_llm.kernels.triton_rl_losses as fused

    logp, old, adv, mask, ref, entropy, rollout = _loss_inputs(3, 1030, 4)  # two blocks per row: six tasks
    den = mask.sum().float()
    runs = []
    for programs in (None, 4, 1):
        x = logp.clone().requires_grad_()
        loss, metrics = fused.fused_policy_loss(x, old, adv, mask, den, den, clip_low=0.2, clip_high=0.2,
                                                ref_logp=ref, kl_coef=0.1, kl_kind="k1", programs=programs)
        loss.backward()
        v = logp.clone().requires_grad_()
        vloss, vmetrics = fused.fused_value_loss(v, old, ref, mask, 0.2, den, programs=programs)
        vloss.backward()
        runs.append((loss.detach(), metrics["pg_clipfrac"], x.grad, vloss.detach(), vmetrics["vf_clipfrac"], v.grad))
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0])), "programs looping over tasks differ"
    # An exact tie of the max with different sides: v = 0.5 clipped to 0.25, returns 0.375 midway, so
    # vf1 == vf2 == 1/64 while only vf1 depends on v: torch sends half the gradient to each side.
    tie = {}
    for kernel in ("triton", "torch"):
        x = torch.tensor([[0.5, 0.125]], requires_grad=True)
        with _env("MINDSPEED_LOSS_KERNEL", kernel):
            loss, _ = ca.value_loss(x, torch.zeros(1, 2), torch.tensor([[0.375, 0.0]]), torch.ones(1, 2), 0.25)
        loss.backward()
        tie[kernel] = x.grad
    torch.testing.assert_close(tie["triton"], tie["torch"], rtol=0, atol=0)
    assert tie["torch"][0, 0] == 0.03125, tie  # 0.5 * 1/2 * (0.5 * 2 * 0.125 + 0.5 * 0); 0.0625 without the split
    print(f"{n} loss cases ok")


def check_compiles_for_cuda():
    """The real (not interpreted) kernels through Triton's compiler down to a cubin for sm_90 (H100 / H200),
    with the wheel's own ptxas: no GPU is needed to compile, only to run. Every constexpr branch is compiled."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mindspeed_llm.kernels import triton_rl_losses as losses
    from mindspeed_llm.kernels import triton_scans as scans
    from mindspeed_llm.rl.core_algos.kl import K3_LOG_RATIO_BOUND, K3_VALUE_BOUND

    target = GPUTarget("cuda", 90, 32)

    def build(fn, signature, constexprs, num_warps=4):
        kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=target,
                                options={"num_warps": num_warps})
        assert kernel.asm.get("cubin"), (fn.__name__, constexprs)

    for dtype, mask_dtype in (("fp32", "u8"), ("bf16", "fp32")):
        sig = {"rewards_ptr": f"*{dtype}", "values_ptr": f"*{dtype}", "mask_ptr": f"*{mask_dtype}",
               "out_ptr": f"*{dtype}", "returns_ptr": f"*{dtype}", "stride_r": "i32", "stride_v": "i32",
               "stride_m": "i32", "stride_o": "i32", "stride_ret": "i32", "length": "i32", "rows": "i32",
               "gamma": "fp32",
               "coef": "fp32", "GAE": "constexpr", "BLOCK_T": "constexpr"}
        for gae in (True, False):
            build(scans._reverse_scan_kernel, sig, {"GAE": gae, "BLOCK_T": scans.BLOCK_T})

    policy_sig = {name: "*fp32" for name in ("logp_ptr", "old_ptr", "adv_ptr", "ref_ptr", "ent_ptr", "rollout_ptr",
                                             "seq_ptr", "loss_den_ptr", "tok_den_ptr", "grad_logp_ptr",
                                             "grad_ent_ptr", "partial_ptr")}
    policy_sig["mask_ptr"] = "*u8"
    policy_sig.update({name: "i32" for name in ("s_logp", "s_old", "s_adv_row", "s_adv_col", "s_mask", "s_ref",
                                                "s_ent", "s_rollout", "s_grad", "s_grad_ent", "length", "n_blocks",
                                                "n_tasks")})
    policy_sig.update({name: "fp32" for name in ("lo", "hi", "dual_clip", "kl_coef", "entropy_coeff",
                                                 "is_threshold")})
    flags = ("SEQUENCE_RATIO", "DUAL", "KL", "ENTROPY", "ENTROPY_GRAD", "IS", "LOGP_GRAD", "N_METRICS", "BLOCK_T",
             "K3_LOG_RATIO_BOUND", "K3_VALUE_BOUND")
    policy_sig.update({name: "constexpr" for name in flags})
    order = ["logp_ptr", "old_ptr", "adv_ptr", "mask_ptr", "ref_ptr", "ent_ptr", "rollout_ptr", "seq_ptr",
             "loss_den_ptr", "tok_den_ptr", "grad_logp_ptr", "grad_ent_ptr", "partial_ptr", "s_logp", "s_old",
             "s_adv_row", "s_adv_col", "s_mask", "s_ref", "s_ent", "s_rollout", "s_grad", "s_grad_ent", "length",
             "n_blocks", "n_tasks", "lo", "hi", "dual_clip", "kl_coef", "entropy_coeff", "is_threshold", *flags]
    policy_sig = {k: policy_sig[k] for k in order}
    # (SEQUENCE_RATIO, DUAL, KL, ENTROPY, ENTROPY_GRAD, IS, LOGP_GRAD): every branch at least once.
    combos = [(False, False, 0, False, False, 0, True), (False, True, 1, True, True, 1, True),
              (True, False, 2, True, False, 2, True), (False, True, 3, True, True, 0, False),
              (False, False, 4, False, False, 1, True)]
    for i, combo in enumerate(combos):
        sig = dict(policy_sig)
        if i % 2:  # bf16 inputs on every other combination
            for name in ("logp_ptr", "old_ptr", "adv_ptr", "ref_ptr", "ent_ptr", "rollout_ptr"):
                sig[name] = "*bf16"
        constants = combo + (len(losses.POLICY_METRICS), losses.BLOCK_T, K3_LOG_RATIO_BOUND, K3_VALUE_BOUND)
        build(losses._policy_loss_kernel, sig, dict(zip(flags, constants)))
    for dtype in ("fp32", "bf16"):
        sig = {"values_ptr": f"*{dtype}", "old_ptr": f"*{dtype}", "returns_ptr": f"*{dtype}", "mask_ptr": "*fp32",
               "tok_den_ptr": "*fp32", "grad_ptr": "*fp32", "partial_ptr": "*fp32", "s_values": "i32", "s_old": "i32",
               "s_returns": "i32", "s_mask": "i32", "s_grad": "i32", "length": "i32", "n_blocks": "i32",
               "n_tasks": "i32", "cliprange": "fp32",
               "VALUE_GRAD": "constexpr", "N_METRICS": "constexpr", "BLOCK_T": "constexpr"}
        for grad in (True, False):
            build(losses._value_loss_kernel, sig, {"VALUE_GRAD": grad, "N_METRICS": len(losses.VALUE_METRICS),
                                                   "BLOCK_T": losses.BLOCK_T})
    print("compiled for sm_90")


def _run_child(check, timeout=600, interpret=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
    for name in ("MINDSPEED_SCAN_KERNEL", "MINDSPEED_LOSS_KERNEL"):
        env.pop(name, None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), check], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    mode = "under TRITON_INTERPRET=1" if interpret else "(Triton's compiler, no interpreter)"
    assert proc.returncode == 0, (f"{check} failed {mode} (exit {proc.returncode}):\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")


# ----------------------------------------------------------------------------------------------------
# pytest


def check_interpreted():
    check_scans()
    check_losses()


@needs_triton
def test_scan_kernel_and_fused_losses_against_the_torch_paths():
    """check_scans and check_losses in one child process (one interpreter start-up)."""
    _run_child("check_interpreted")


@needs_triton
def test_kernels_compile_for_cuda_without_a_gpu():
    _run_child("check_compiles_for_cuda", interpret=False)


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the compiled kernels on a CUDA device")
def test_cuda_kernels_at_real_shapes():
    """On a GPU: the compiled kernels at B = 64, T = 8k (eight blocks per row) against the torch paths, chosen by
    default on CUDA."""
    from mindspeed_llm.kernels import select_kernel
    from mindspeed_llm.rl import core_algos as ca
    from mindspeed_llm.rl.core_algos import scans

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: this test is about the compiled kernels")
    dev = torch.device("cuda")
    for family, env in (("scans", "MINDSPEED_SCAN_KERNEL"), ("losses", "MINDSPEED_LOSS_KERNEL")):
        assert os.environ.get(env, "auto") != "auto" or select_kernel(family, dev) == "triton"
    rewards, values, mask = (t.to(dev) for t in _scan_case(64, 8192, 0))
    adv, ret = scans.gae_scan(rewards, values, mask, 0.99, 0.95, kernel="triton")
    ref_adv, ref_ret = scans.gae_scan(rewards.double(), values.double(), mask, 0.99, 0.95, kernel="torch")
    torch.testing.assert_close(adv.double(), ref_adv, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ret.double(), ref_ret, rtol=1e-5, atol=1e-4)
    got = scans.discounted_returns(rewards, mask, 1.0, kernel="triton")
    torch.testing.assert_close(got.double(), scans.discounted_returns(rewards.double(), mask, 1.0, kernel="torch"),
                               rtol=1e-5, atol=1e-4)
    inputs = [t.to(dev) for t in _loss_inputs(64, 8192, 1)]
    for kw in POLICY_CASES:
        got = _policy("triton", torch.float32, *inputs, kw)
        want = _policy("torch", torch.float32, *inputs, kw)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-6)
        for k in want[1]:
            torch.testing.assert_close(got[1][k], want[1][k], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-9)


if __name__ == "__main__":
    torch.set_num_threads(1)
    globals()[sys.argv[1]]()
