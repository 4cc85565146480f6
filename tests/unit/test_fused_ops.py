"""The fused ops of the `--use-fused-*` flags.

The plain-torch references of torch_npu's `npu_rms_norm`, `npu_swiglu` and `npu_rotary_position_embedding`
(mindspeed_llm/kernels/npu_reference.py, which the CPU stand-in of torch_npu installs) against independent
computations: hand-computed values, a float64 loop, and the rotation of each pair of features as a complex number."""

from __future__ import annotations

import math

import pytest
import torch

from mindspeed_llm.kernels import npu_reference as ref


# ------------------------------------------------------------------------------------------ the reference ops
def test_npu_rms_norm_reference_hand_computed_and_rstd_layout():
    x = torch.tensor([[3.0, 4.0], [1.0, -1.0]])
    gamma = torch.tensor([2.0, 0.5])
    y, rstd = ref.npu_rms_norm(x, gamma, epsilon=0.0)
    # mean of squares: 12.5 and 1.0
    assert torch.allclose(rstd, torch.tensor([[1 / math.sqrt(12.5)], [1.0]]))
    assert torch.allclose(y, torch.tensor([[6 / math.sqrt(12.5), 2 / math.sqrt(12.5)], [2.0, -0.5]]))
    eps = 0.25
    _, rstd = ref.npu_rms_norm(x, gamma, epsilon=eps)
    assert torch.allclose(rstd[1], torch.tensor([1 / math.sqrt(1.0 + eps)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_npu_rms_norm_reference_against_a_float64_loop(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 8, generator=g) * 3).to(dtype)
    gamma = torch.randn(8, generator=g).to(dtype)
    y, rstd = ref.npu_rms_norm(x, gamma, epsilon=1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    assert rstd.dtype == torch.float32 and rstd.shape == (3, 5, 1)
    for i in range(3):
        for j in range(5):
            row = [float(v) for v in x[i, j]]
            inv = 1.0 / math.sqrt(sum(v * v for v in row) / len(row) + 1e-5)
            assert abs(float(rstd[i, j, 0]) - inv) <= 1e-6 * inv
            want = torch.tensor([v * inv * float(w) for v, w in zip(row, gamma)], dtype=torch.float64)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            assert torch.allclose(y[i, j].double(), want, rtol=tol, atol=tol)
    # a gamma over the two trailing dimensions normalises over both
    gamma2 = torch.randn(5, 8, generator=g)
    y2, rstd2 = ref.npu_rms_norm(x.float(), gamma2, epsilon=1e-5)
    assert rstd2.shape == (3, 1, 1)
    x64 = x.double()
    want2 = x64 / torch.sqrt(x64.pow(2).mean(dim=(1, 2), keepdim=True) + 1e-5) * gamma2.double()
    assert torch.allclose(y2.double(), want2, atol=1e-5)
    with pytest.raises(ValueError, match="gamma"):
        ref.npu_rms_norm(x, torch.ones(7))


def test_npu_swiglu_reference_splits_first_half_gated():
    def silu(v):
        return v / (1.0 + math.exp(-v))

    x = torch.tensor([[1.0, -2.0, 3.0, 0.5]])  # a = [1, -2], b = [3, 0.5]
    out = ref.npu_swiglu(x)
    assert torch.allclose(out, torch.tensor([[silu(1.0) * 3.0, silu(-2.0) * 0.5]]))
    along0 = ref.npu_swiglu(x.t().contiguous(), dim=0)  # [4, 1] split along rows
    assert torch.allclose(along0, out.t())
    with pytest.raises(ValueError, match="odd"):
        ref.npu_swiglu(torch.ones(2, 3))


def _rotated_as_complex(x, angles, mode):
    """Each pair of features rotated by its angle as a complex product: pairs (j, j + D/2) in mode 0, (2j, 2j+1) in
    mode 1. `x` [..., S, D] (any leading dims), `angles` [S, D/2]."""
    d = x.size(-1)
    x64 = x.double()
    if mode == 0:
        pairs = torch.complex(x64[..., : d // 2], x64[..., d // 2:])
    else:
        pairs = torch.complex(x64[..., 0::2], x64[..., 1::2])
    turned = pairs * torch.polar(torch.ones_like(angles), angles)
    if mode == 0:
        return torch.cat((turned.real, turned.imag), dim=-1)
    return torch.stack((turned.real, turned.imag), dim=-1).flatten(-2)


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("layout", ["BNSD", "BSND", "SBND"])
def test_npu_rotary_position_embedding_reference_rotates_each_pair(mode, layout):
    b, n, s, d = 2, 3, 5, 8
    g = torch.Generator().manual_seed(1)
    x_bnsd = torch.randn(b, n, s, d, generator=g, dtype=torch.float64)
    angles = torch.rand(s, d // 2, generator=g, dtype=torch.float64) * 6.0
    per_feature = torch.cat((angles, angles), -1) if mode == 0 else angles.repeat_interleave(2, dim=-1)
    cos, sin = per_feature.cos(), per_feature.sin()  # [S, D]
    to_layout = {"BNSD": (0, 1, 2, 3), "BSND": (0, 2, 1, 3), "SBND": (2, 0, 1, 3)}[layout]
    table_shape = {"BNSD": (1, 1, s, d), "BSND": (1, s, 1, d), "SBND": (s, 1, 1, d)}[layout]
    x = x_bnsd.permute(*to_layout).contiguous()
    out = ref.npu_rotary_position_embedding(x, cos.reshape(table_shape), sin.reshape(table_shape), mode)
    want = _rotated_as_complex(x_bnsd, angles, mode).permute(*to_layout)
    assert torch.allclose(out, want, atol=1e-12)


def test_npu_rotary_position_embedding_reference_refuses_what_the_op_refuses():
    x = torch.randn(1, 2, 3, 4)
    table = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="mode"):
        ref.npu_rotary_position_embedding(x, table, table, 2)
    with pytest.raises(ValueError, match="4-D"):
        ref.npu_rotary_position_embedding(x[0], table, table, 0)
    with pytest.raises(ValueError, match="broadcast"):
        ref.npu_rotary_position_embedding(x, table[..., :2], table[..., :2], 0)
    per_row = torch.randn(1, 2, 3, 4)  # B1SD-like: a table per batch row, which mode 1 does not take
    ref.npu_rotary_position_embedding(torch.randn(1, 2, 3, 4), per_row, per_row, 0)
    with pytest.raises(ValueError, match="one table row per position"):
        ref.npu_rotary_position_embedding(torch.randn(1, 2, 3, 4), per_row, per_row, 1)
    with pytest.raises(ValueError, match="below 896"):
        wide = torch.randn(1, 1, 2, 896)
        ref.npu_rotary_position_embedding(wide, wide, wide, 0)


# ------------------------------------------------------------- the ops the flags run, against megatron's path
def _megatron_rotary():
    """megatron's unfused `_apply_rotary_pos_emb_bshd`, also when this process has applied the CPU rotary patch."""
    from mindspeed_llm import patches
    from mindspeed_llm.patches.rotary import _TARGET

    for _owner, _attr, original, target in patches._APPLIED:
        if target == _TARGET:
            return original
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils._apply_rotary_pos_emb_bshd


def _megatron_glu(x):
    """megatron's MLP without bias_activation_fusion (gated, silu)."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _value_and_grads(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*inputs)
    weights = torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape).to(out.dtype)
    (out * weights).float().sum().backward()
    return out.detach(), [t.grad for t in inputs if t.requires_grad]


def _close(a, b, dtype):
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    return torch.allclose(a.float(), b.float(), **tol)


def _norm_pair(dtype, hidden=32, eps=1e-5):
    from mindspeed_llm.models.fused_ops import use_fused_norms

    torch.manual_seed(0)
    plain = torch.nn.RMSNorm(hidden, eps=eps).to(dtype)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(hidden))
    fused = torch.nn.Sequential(torch.nn.RMSNorm(hidden, eps=eps).to(dtype))
    fused.load_state_dict({"0.weight": plain.weight.detach()})
    assert use_fused_norms(fused) == 1
    return plain, fused[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rmsnorm_equals_torchs_rmsnorm(dtype):
    plain, fused = _norm_pair(dtype)
    x = (torch.randn(5, 3, 32, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    want, (want_gx,) = _value_and_grads(plain, x)
    got, (got_gx,) = _value_and_grads(fused, x)
    assert torch.equal(got, want)  # the same op order in the forward
    assert _close(got_gx, want_gx, dtype)
    for module in (plain, fused):
        module.weight.grad = None
    _value_and_grads(plain, x)
    _value_and_grads(fused, x)
    assert _close(fused.weight.grad, plain.weight.grad, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_swiglu_equals_megatrons_glu(dtype):
    from mindspeed_llm.kernels.fused_ops import lean_swiglu
    from mindspeed_llm.patches.fused_ops import _swiglu_impl, _weighted_swiglu_impl

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(6, 2, 16, generator=g) * 3).to(dtype)
    want, (want_g,) = _value_and_grads(_megatron_glu, x)
    got, (got_g,) = _value_and_grads(lambda t: _swiglu_impl(lean_swiglu)(t, None), x)
    assert torch.equal(got, want) and _close(got_g, want_g, dtype)
    bias = torch.randn(16, generator=g).to(dtype)
    want, grads = _value_and_grads(lambda t, b: _megatron_glu(t + b), x, bias)
    got, got_grads = _value_and_grads(lambda t, b: _swiglu_impl(lean_swiglu)(t, b), x, bias)
    assert torch.equal(got, want) and all(_close(a, b, dtype) for a, b in zip(got_grads, grads))
    # MoE experts: the routing weights multiply the activation (megatron's unfused per_token_scale path)
    tokens = x.reshape(-1, 16)
    probs = torch.rand(tokens.size(0), 1, generator=g)
    want, grads = _value_and_grads(lambda t, p: (_megatron_glu(t) * p).to(t.dtype), tokens, probs)
    got, got_grads = _value_and_grads(lambda t, p: _weighted_swiglu_impl(lean_swiglu)(t, None, p), tokens, probs)
    assert torch.equal(got, want) and all(_close(a, b, dtype) for a, b in zip(got_grads, grads))


def test_the_cpu_ops_save_less_for_backward_than_megatrons_path():
    """The memory claim of the flags on CPU: bytes of the distinct storages autograd saves (inputs included)."""
    from mindspeed_llm.kernels.fused_ops import lean_swiglu

    def saved(fn, *inputs):
        kept = {}

        def pack(t):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(*inputs)
        return sum(kept.values())

    tokens, hidden, ffn = 64, 128, 256
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    plain, fused = _norm_pair(torch.bfloat16, hidden)
    x_bytes, rstd_bytes, weight_bytes = tokens * hidden * 2, tokens * 4, hidden * 2
    assert saved(fused, x) == x_bytes + rstd_bytes + weight_bytes
    assert saved(plain, x) >= 4 * x_bytes  # float32 copies of the input and of the normalised value
    up = torch.randn(tokens, 2 * ffn, dtype=torch.bfloat16, requires_grad=True)
    assert saved(lean_swiglu, up) == tokens * 2 * ffn * 2  # the input only
    assert saved(_megatron_glu, up) == tokens * 3 * ffn * 2  # the input and silu(gate)
    # why --use-fused-rotary-pos-emb is ignored off the NPU: megatron's unfused RoPE keeps cos / sin only
    q = torch.randn(16, 2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    assert saved(lambda t: _megatron_rotary()(t, torch.rand(16, 1, 1, 64)), q) == 2 * 16 * 64 * 2


# ----------------------------------------------------------- the NPU translation, on a stand-in of torch_npu
@pytest.fixture
def npu_stand_in(monkeypatch):
    """torch_npu's three ops as the references (recording each call), and the device layer answering "npu"."""
    import sys
    import types

    from mindspeed_llm import device

    calls = []

    def recorded(name, fn):
        def op(*args, **kwargs):
            calls.append((name, args, kwargs))
            return fn(*args, **kwargs)
        return op

    stand_in = types.SimpleNamespace(**{name: recorded(name, getattr(ref, name)) for name in
                                        ("npu_rms_norm", "npu_swiglu", "npu_rotary_position_embedding")})
    monkeypatch.setitem(sys.modules, "torch_npu", stand_in)
    monkeypatch.setattr(device, "accelerator", lambda: device.Accelerator("npu", "hccl"))
    return calls


def test_npu_ops_are_called_with_the_documented_arguments(npu_stand_in):
    from mindspeed_llm.patches.fused_ops import _npu_rotary, _npu_swiglu, _rotary_impl, _swiglu_impl

    calls = npu_stand_in
    _, fused = _norm_pair(torch.float32, 16, eps=1e-5)
    x = torch.randn(3, 2, 16)
    assert torch.allclose(fused(x), torch.nn.functional.rms_norm(x, (16,), fused.weight, 1e-5), atol=1e-6)
    name, args, kwargs = calls[-1]
    assert name == "npu_rms_norm" and args[0] is x and args[1] is fused.weight and kwargs == {"epsilon": 1e-5}

    up = torch.randn(5, 2, 12)
    assert torch.allclose(_swiglu_impl(_npu_swiglu)(up, None), _megatron_glu(up))
    assert calls[-1][0] == "npu_swiglu" and calls[-1][2] == {"dim": -1}



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [dict(), dict(interleaved=True), dict(rot_dim=8), dict(per_row=True),
                                  dict(per_row=True, interleaved=True)])
def test_npu_rotary_equals_megatrons_unfused_rotary(npu_stand_in, dtype, case):
    from mindspeed_llm.patches.fused_ops import _npu_rotary, _rotary_impl

    s, b, n, d = 7, 3, 4, 16
    rot_dim = case.get("rot_dim", d)
    g = torch.Generator().manual_seed(3)
    t = torch.randn(s, b, n, d, generator=g).to(dtype)
    # [S, 1, 1, D] as megatron's rotary module gives it, [S, B, 1, D] as forward_layout indexes it by position ids
    freqs = torch.rand(s, b if case.get("per_row") else 1, 1, rot_dim, generator=g) * 5
    interleaved = case.get("interleaved", False)
    want, (want_g,) = _value_and_grads(lambda x: _megatron_rotary()(x, freqs, rotary_interleaved=interleaved), t)
    got, (got_g,) = _value_and_grads(lambda x: _rotary_impl(_npu_rotary)(x, freqs, interleaved=interleaved), t)
    assert torch.equal(got, want)
    assert _close(got_g, want_g, dtype)
    if interleaved and case.get("per_row"):  # mode 1 takes no per-row tables (documented): megatron's math instead
        assert not npu_stand_in
        return
    name, (x_arg, cos_arg, sin_arg, mode_arg), _ = npu_stand_in[-1]
    # SBND: the rotated part (partial rotary: the first rot_dim features), cos / sin [S, 1 or B, 1, rot_dim]
    assert name == "npu_rotary_position_embedding" and mode_arg == (1 if interleaved else 0)
    assert x_arg.shape == (s, b, n, rot_dim) and x_arg.is_contiguous()
    assert cos_arg.shape == sin_arg.shape == freqs.shape and cos_arg.dtype == dtype


def test_each_fused_op_patch_names_its_flag_once_per_device():
    from mindspeed_llm import patches
    from mindspeed_llm.patches import fused_ops

    for target, flag, devices in ((fused_ops.SWIGLU, "--use-fused-swiglu", ["cpu", "cuda", "npu"]),
                                  (fused_ops.WEIGHTED_SWIGLU, "--use-fused-swiglu", ["cpu", "cuda", "npu"]),
                                  (fused_ops.ROTARY, "--use-fused-rotary-pos-emb", ["npu"])):
        mine = [p for p in patches.registry() if p.target == target]
        assert sorted(d for p in mine for d in p.devices) == devices, target
        assert all(flag in p.reason for p in mine)
        assert "torch_npu" in next(p for p in mine if "npu" in p.devices).reason
