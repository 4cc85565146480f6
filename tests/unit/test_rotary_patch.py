"""The CPU rotary patch (mindspeed_llm/patches/rotary.py) returns megatron-core 0.16.1's rotary embedding bit for
bit, values and gradients, in every case its shortcuts touch (the cos / sin kept between calls, mscale 1.0, the
empty pass-through) and in those it hands back to megatron (partial rotary dimension, interleaved, multi-latent
attention, mscale != 1); a table modified in place is not served from the cache."""

from __future__ import annotations

import pytest
import torch

from mindspeed_llm import patches
from mindspeed_llm.patches.rotary import _TARGET, _rotary_without_recomputed_tables


def _megatron_original():
    """megatron's own function, also when this process has applied the patches already."""
    for owner, attr, original, target in patches._APPLIED:
        if target == _TARGET:
            return original
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils._apply_rotary_pos_emb_bshd


def _inputs(seed, seq=7, batch=3, heads=4, dim=16, rot_dim=16):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(seq, batch, heads, dim, generator=g, dtype=torch.float64).float()
    freqs = torch.randn(seq, batch, 1, rot_dim, generator=g) * 3.0
    return t, freqs


def _value_and_grad(fn, t, freqs, **kw):
    t = t.clone().requires_grad_(True)
    out = fn(t, freqs, **kw)
    weights = torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape)
    (out * weights).sum().backward()
    return out.detach(), t.grad


@pytest.mark.parametrize("case", [
    dict(), dict(mscale=1.0), dict(mscale=0.7), dict(rotary_interleaved=True), dict(multi_latent_attention=True),
    dict(rot_dim=8), dict(rot_dim=8, mscale=1.3),
])
def test_same_values_and_gradients_as_megatron(case):
    case = dict(case)
    rot_dim = case.pop("rot_dim", 16)
    original = _megatron_original()
    patched = _rotary_without_recomputed_tables(original)
    t, freqs = _inputs(0, rot_dim=rot_dim)
    for call in range(3):  # the 2nd and 3rd calls reuse the first call's cos / sin
        q = t * (call + 1)
        ref, ref_grad = _value_and_grad(original, q, freqs, **case)
        out, grad = _value_and_grad(patched, q, freqs, **case)
        assert torch.equal(out, ref), (case, call)
        assert torch.equal(grad, ref_grad), (case, call)


def test_a_table_changed_in_place_or_a_new_table_is_not_served_from_the_cache():
    original = _megatron_original()
    patched = _rotary_without_recomputed_tables(original)
    t, freqs = _inputs(1)
    assert torch.equal(patched(t, freqs), original(t, freqs))
    freqs.mul_(0.5)  # same object, new values
    assert torch.equal(patched(t, freqs), original(t, freqs))
    other = torch.randn_like(freqs)
    assert torch.equal(patched(t, other), original(t, other))
    assert torch.equal(patched(t, freqs, mscale=2.0), original(t, freqs, mscale=2.0))  # same table, other mscale
    assert torch.equal(patched(t.double(), freqs), original(t.double(), freqs))  # same table, other dtype


def test_a_table_that_requires_grad_gets_its_gradient():
    original = _megatron_original()
    patched = _rotary_without_recomputed_tables(original)
    t, freqs = _inputs(2)
    grads = []
    for fn in (original, patched, patched):
        f = freqs.clone().requires_grad_(True)
        fn(t, f).sum().backward()
        grads.append(f.grad)
    assert torch.equal(grads[1], grads[0]) and torch.equal(grads[2], grads[0])
