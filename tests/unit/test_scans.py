"""core_algos.scans, the torch path (CPU): GAE and the REINFORCE++ returns as log-depth scans against the
per-position loops they replace (``gae_scan_loop`` / ``discounted_returns_loop``, TRL's and verl's recursions) and
against a float64 loop, at lengths that take every level of the chunked scan (T = 1, 15, 16, 17, 256, 257, 4099:
inside one chunk, one chunk exactly, a masked tail, two and three levels).

Tolerance (fp32). The scan sums the same products as the loop in a tree of depth about ``2 log2 T`` instead of a
chain of ``T``, so against the float64 loop its error at ``t`` is at most ``(2 log2 T + 4) eps S_t`` with
``S_t = sum_{k >= t} |prod_{t <= j < k} c_j| |a_k|`` (the magnitudes the result is a sum of; for GAE ``|a_k|`` is
``|r_k| + gamma |V_{k+1}| + |V_k|``, delta being a sum itself) and ``eps``
fp32's epsilon; the loop's own error has the same form with ``T`` in place of the depth (at these lengths both
measured at most ~2.6 eps S_t, benchmarks/README.md). Scan vs fp32 loop is checked at twice that bound. In float64
both are compared with the loop at 1e-12 relative to S_t.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mindspeed_llm.rl import core_algos as ca
from mindspeed_llm.rl.core_algos import scans

LENGTHS = (1, 15, 16, 17, 256, 257, 4099)
EPS32 = torch.finfo(torch.float32).eps


def _magnitudes(a, c):
    """S_t = sum_{k >= t} prod_{t <= j < k} |c_j| |a_k| (float64, a loop)."""
    a, c = a.double().abs(), c.double().abs().expand_as(a)
    out = torch.zeros_like(a)
    running = torch.zeros_like(a[:, 0])
    for t in reversed(range(a.size(1))):
        running = a[:, t] + c[:, t] * running
        out[:, t] = running
    return out


def _bound(length):
    return (2 * math.log2(max(length, 2)) + 4) * EPS32


def _case(length, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(4, length, generator=g)
    values = torch.randn(4, length, generator=g)
    mask = torch.rand(4, length, generator=g) > 0.15  # interior holes everywhere
    mask[1, length // 2:] = False  # a right-padded row
    mask[2] = False  # an empty one
    return rewards, values, mask


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_scan_matches_the_loop(length, gamma, lam):
    rewards, values, mask = _case(length, length)
    adv, ret = scans.gae_scan(rewards, values, mask, gamma, lam)
    loop_adv, loop_ret = scans.gae_scan_loop(rewards, values, mask, gamma, lam)
    exact_adv, exact_ret = scans.gae_scan_loop(rewards.double(), values.double(), mask, gamma, lam)
    assert adv.dtype == ret.dtype == torch.float32 and adv.shape == rewards.shape
    masked = values.double() * mask
    # delta is a sum itself: its magnitudes are |r_t| + gamma |V_{t+1}| + |V_t|
    delta_size = rewards.double().abs() + gamma * F.pad(masked[:, 1:], (0, 1)).abs() + masked.abs()
    size = _magnitudes(delta_size, torch.tensor(gamma * lam))
    bound = _bound(length) * size
    assert ((adv.double() - exact_adv).abs() <= bound).all()
    assert ((adv - loop_adv).double().abs() <= 2 * bound).all()
    assert ((ret.double() - exact_ret).abs() <= bound + EPS32 * (exact_ret.abs() + masked.abs())).all()
    assert ((ret - loop_ret).double().abs() <= 2 * bound + 2 * EPS32 * (exact_ret.abs() + masked.abs())).all()
    # float64: the same numbers up to float64 rounding.
    adv64, ret64 = scans.gae_scan(rewards.double(), values.double(), mask, gamma, lam)
    assert ((adv64 - exact_adv).abs() <= 1e-12 * size).all() and ((ret64 - exact_ret).abs() <= 1e-12 * (size + 1)).all()


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("gamma", [1.0, 0.97])
def test_discounted_returns_match_the_loop(length, gamma):
    rewards, _, mask = _case(length, 100 + length)
    got = scans.discounted_returns(rewards, mask, gamma)
    loop = scans.discounted_returns_loop(rewards, mask, gamma)
    exact = scans.discounted_returns_loop(rewards.double(), mask, gamma)
    size = _magnitudes(rewards, gamma * F.pad(mask.double()[:, 1:], (0, 1)))
    bound = _bound(length) * size
    assert got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= bound).all()
    assert ((got - loop).double().abs() <= 2 * bound).all()
    got64 = scans.discounted_returns(rewards.double(), mask, gamma)
    assert ((got64 - exact).abs() <= 1e-12 * size).all()
    # A hole stops the return: just before a masked position the return is the reward alone.
    before_hole = torch.zeros_like(mask)
    before_hole[:, :-1] = ~mask[:, 1:]
    before_hole[:, -1] = True
    torch.testing.assert_close(got[before_hole], rewards[before_hole], rtol=0, atol=0)


def test_reverse_linear_scan_general_coefficients_and_gradient():
    """Any coefficients (a float mask's weights, negative ones), a leading batch shape, and the gradient of the
    scan equal to the loop's (the torch path is differentiable)."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(2, 3, 300, dtype=torch.float64, generator=g)
    c = torch.rand(2, 3, 300, dtype=torch.float64, generator=g) * 2 - 0.9
    expected = torch.zeros_like(a)
    running = torch.zeros_like(a[..., 0])
    for t in reversed(range(300)):
        running = a[..., t] + c[..., t] * running
        expected[..., t] = running
    torch.testing.assert_close(ca.reverse_linear_scan(a, c), expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ca.reverse_linear_scan(a, 0.7)[..., :5],
                               ca.reverse_linear_scan(a, torch.full_like(a, 0.7))[..., :5], rtol=1e-12, atol=1e-12)
    # Gradients through the scan vs through the loop (w.r.t. both a and c).
    weights = torch.randn(2, 3, 300, dtype=torch.float64, generator=g)
    a1, c1 = a.clone().requires_grad_(), c.clone().requires_grad_()
    (ca.reverse_linear_scan(a1, c1) * weights).sum().backward()
    a2, c2 = a.clone().requires_grad_(), c.clone().requires_grad_()
    running, outs = torch.zeros_like(a[..., 0]), []
    for t in reversed(range(300)):
        running = a2[..., t] + c2[..., t] * running
        outs.append(running)
    (torch.stack(outs[::-1], dim=-1) * weights).sum().backward()
    torch.testing.assert_close(a1.grad, a2.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(c1.grad, c2.grad, rtol=1e-10, atol=1e-10)
    # Empty and one-position rows.
    assert ca.reverse_linear_scan(torch.zeros(3, 0), 0.9).shape == (3, 0)
    torch.testing.assert_close(ca.reverse_linear_scan(a[..., :1], 0.9), a[..., :1])


def test_compute_gae_and_reinforce_plus_plus_use_the_scans(monkeypatch):
    """The estimators the stages call run the scans (no Python loop over T): compute_gae through gae_scan,
    REINFORCE++ through discounted_returns, with the results of the loops."""
    rewards, values, mask = _case(257, 7)
    calls = []
    real_gae, real_returns = scans.gae_scan, scans.discounted_returns
    monkeypatch.setattr("mindspeed_llm.rl.core_algos.rewards.gae_scan",
                        lambda *a, **k: calls.append("gae") or real_gae(*a, **k))
    monkeypatch.setattr("mindspeed_llm.rl.core_algos.advantages.discounted_returns",
                        lambda *a, **k: calls.append("returns") or real_returns(*a, **k))
    adv, ret = ca.compute_gae(rewards, values, mask, 1.0, 0.95)
    loop_adv, loop_ret = scans.gae_scan_loop(rewards, values, ca.response_mask_p1(mask), 1.0, 0.95)
    whitened = ca.masked_whiten(loop_adv, mask) * mask
    torch.testing.assert_close(adv, whitened, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, loop_ret, rtol=1e-5, atol=1e-5)
    rpp = ca.ADV_ESTIMATORS["reinforce_plus_plus"].fn(rewards, mask, gamma=0.9)
    loop = scans.discounted_returns_loop(rewards, mask, 0.9)
    torch.testing.assert_close(rpp, ca.masked_whiten(loop, mask.float()) * mask, rtol=1e-5, atol=1e-5)
    assert calls == ["gae", "returns"]


def test_scan_kernel_choice(monkeypatch):
    """Scans and losses: auto takes Triton on CUDA and (with Triton-Ascend) on NPUs, the torch path on CPU; the
    environment variables and their errors name the family."""
    import mindspeed_llm.kernels as kernels

    for env in ("MINDSPEED_SCAN_KERNEL", "MINDSPEED_LOSS_KERNEL", "TRITON_INTERPRET"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    monkeypatch.setattr(kernels, "triton_ascend_available", lambda: False)
    for family in ("scans", "losses"):
        assert kernels.select_kernel(family, torch.device("cpu")) == "torch"
        assert kernels.select_kernel(family, torch.device("cuda", 0)) == "triton"
        assert kernels.select_kernel(family, "npu") == "torch"  # no Triton-Ascend
    monkeypatch.setattr(kernels, "triton_ascend_available", lambda: True)
    assert kernels.select_kernel("scans", "npu") == "triton"
    assert kernels.select_kernel("losses", "npu") == "triton"
    assert kernels.select_logprobs_kernel("npu") == "torch"  # the log-prob kernel stays CUDA-only
    monkeypatch.setenv("MINDSPEED_SCAN_KERNEL", "torch")
    assert kernels.select_kernel("scans", torch.device("cuda", 0)) == "torch"
    assert kernels.select_kernel("losses", torch.device("cuda", 0)) == "triton"  # each family its own variable
    monkeypatch.setenv("MINDSPEED_LOSS_KERNEL", "triton")
    with pytest.raises(RuntimeError, match="MINDSPEED_LOSS_KERNEL=triton, but the log-probs / values are on 'cpu'"
                                           ".*TRITON_INTERPRET=1.*MINDSPEED_LOSS_KERNEL=auto or torch"):
        kernels.select_kernel("losses", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.select_kernel("losses", torch.device("cpu")) == "triton"
    with pytest.raises(ValueError, match="MINDSPEED_SCAN_KERNEL='cuda' is not a scan kernel: use one of auto, torch"):
        kernels.select_kernel("scans", "cuda", kernel="cuda")
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="MINDSPEED_SCAN_KERNEL=triton, but Triton is not installed"):
        kernels.select_kernel("scans", "cuda", kernel="triton")
    # On CPU the stages' calls take the torch path whatever is importable.
    monkeypatch.delenv("MINDSPEED_SCAN_KERNEL")
    monkeypatch.delenv("MINDSPEED_LOSS_KERNEL")
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    rewards, values, mask = _case(20, 1)
    torch.testing.assert_close(scans.gae_scan(rewards, values, mask, 1.0, 0.9)[0],
                               scans.gae_scan_loop(rewards, values, mask, 1.0, 0.9)[0], rtol=1e-5, atol=1e-5)


def test_benchmark_rl_math_child_measures_and_checks(monkeypatch):
    """benchmarks/rl_math.py's measurement of one (op, T, variant), in process (no spawn): it times the call, and the
    scan's and the losses' results match their baselines (max_abs_diff)."""
    import argparse
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "benchmarks", "rl_math.py")
    spec = importlib.util.spec_from_file_location("rl_math_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setenv("MINDSPEED_LOSS_KERNEL", "torch")
    threads = torch.get_num_threads()
    try:
        for op, variant in (("gae", "scan"), ("rpp_returns", "scan"), ("policy_loss", "torch"), ("value_loss", "torch")):
            opts = argparse.Namespace(device="cpu", op=op, variant=variant, batch=3, length=50, repeats=1, threads=1,
                                      no_check=False)
            result = bench._child(opts)
            assert result["time_s"] > 0 and isinstance(result["peak_bytes"], int), (op, result)  # peak: fresh process only
            if variant == "scan":
                assert result["max_abs_diff"] < 1e-5, (op, result)
    finally:
        torch.set_num_threads(threads)
