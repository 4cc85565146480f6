"""The fused ops of the `--use-fused-*` flags.

The plain-torch references of torch_npu's `npu_rms_norm`, `npu_swiglu` and `npu_rotary_position_embedding`
(tests/helpers/npu_fused_reference.py, which the CPU stand-in of torch_npu installs) against independent
computations: hand-computed values, a float64 loop, and the rotation of each pair of features as a complex number."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import npu_fused_reference as ref


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
