"""The `torch_npu` stand-in (`tests/helpers/npu_stand_in.py`) and the device layer's NPU branches on it, in process.

* `npu_fusion_attention`'s reference against torch's SDPA (an independent computation): every layout (BNSD, BSND,
  BSH, SBH give one result), `sparse_mode` 0 / 2 / 3, grouped key heads, and TND with *cumulative*
  `actual_seq_qlen` / `actual_seq_kvlen` against SDPA run on each sequence alone.
* Device selection and backend: with the stand-in `device.accelerator()` is NPU / hccl without `MINDSPEED_DEVICE`;
  `device.setup()` imports `transfer_to_npu` and pins `LOCAL_RANK`; seeding, RNG state, synchronize and the profiler
  go through `torch.npu` / `torch_npu.profiler`; after the block no `torch_npu` is left in the process.
The whole NPU path on gloo ranks: tests/dist/test_npu_lane.py.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.npu_stand_in import FusionAttention, installed


def _in_fork(body):
    """`body(stand_in)` in a forked child with the stand-in installed and the device layer choosing afresh: the
    PrivateUse1 rename it needs (`torch.device("npu")`) lasts for a process, so this one never makes it."""
    from tests.helpers.fixtures_data import run_forked

    def child():
        import os

        from mindspeed_llm import device, patches

        os.environ.pop("MINDSPEED_DEVICE", None)
        os.environ["LOCAL_RANK"] = "3"
        patches.apply_patches = lambda kind: []  # megatron stays unpatched
        device._SETUP_DONE = False
        device.accelerator.cache_clear()
        with installed() as stand_in:
            body(stand_in)
        return 0

    status, stderr = run_forked(child)
    assert status == 0, stderr[-4000:]


def _sdpa(q, k, v, scale, masked=None):
    per = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(per, 1), v.repeat_interleave(per, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None if masked is None else ~masked, scale=scale)


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
@pytest.mark.parametrize("mode", [0, 2, 3])
def test_fusion_attention_layouts_and_modes_match_sdpa(layout, mode):
    g = torch.Generator().manual_seed(0)
    b, n, groups, sq, sk, d = 2, 4, 2, 5 if mode == 3 else 7, 7, 8
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h, s in ((n, sq), (groups, sk), (groups, sk)))
    if mode == 0:
        masked = torch.rand(b, 1, sq, sk, generator=g) < 0.3
        masked[..., 0] = False  # no fully masked row
        kwargs = dict(atten_mask=masked)
    else:
        masked = torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (0 if mode == 2 else sk - sq)
        kwargs = dict(atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1))
    to = {"BNSD": lambda t: t, "BSND": lambda t: t.transpose(1, 2).contiguous(),
          "BSH": lambda t: t.transpose(1, 2).reshape(b, t.size(2), -1),
          "SBH": lambda t: t.transpose(1, 2).reshape(b, t.size(2), -1).transpose(0, 1).contiguous()}[layout]
    fa = FusionAttention()
    out = fa(to(q), to(k), to(v), n, layout, scale=0.3, sparse_mode=mode, **kwargs)[0]
    torch.testing.assert_close(out, to(_sdpa(q, k, v, 0.3, masked)), atol=1e-5, rtol=1e-5)
    assert fa.calls[0]["layout"] == layout and fa.calls[0]["sparse_mode"] == mode


def test_fusion_attention_tnd_reads_cumulative_lengths():
    g = torch.Generator().manual_seed(1)
    n, groups, d = 4, 2, 8
    q_lens, k_lens = (2, 5, 3), (4, 5, 6)  # each sequence's queries are the last of its keys (right-down causal)
    q = torch.randn(sum(q_lens), n, d, generator=g)
    k, v = (torch.randn(sum(k_lens), groups, d, generator=g) for _ in range(2))
    fa = FusionAttention()
    out = fa(q, k, v, n, "TND", scale=0.5, sparse_mode=3, atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1),
             actual_seq_qlen=[2, 7, 10], actual_seq_kvlen=[4, 9, 15])[0]
    expected, q0, k0 = [], 0, 0
    for sq, sk in zip(q_lens, k_lens):
        one = [t.transpose(0, 1)[None] for t in (q[q0:q0 + sq], k[k0:k0 + sk], v[k0:k0 + sk])]
        masked = torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + sk - sq
        expected.append(_sdpa(*one, 0.5, masked)[0].transpose(0, 1))
        q0, k0 = q0 + sq, k0 + sk
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)
    assert fa.calls[0]["actual_seq_qlen"] == [2, 7, 10]
    with pytest.raises(ValueError, match="cumulative"):  # lengths given as lengths, not cumulative ends
        fa(q, k, v, n, "TND", scale=0.5, sparse_mode=0, actual_seq_qlen=[2, 5, 3], actual_seq_kvlen=[4, 5, 6])


def test_fusion_attention_refuses_what_it_does_not_model():
    q = torch.randn(1, 2, 3, 4)
    fa = FusionAttention()
    with pytest.raises(NotImplementedError, match="keep_prob"):
        fa(q, q, q, 2, "BNSD", keep_prob=0.9)
    with pytest.raises(ValueError, match="compressed"):
        fa(q, q, q, 2, "BNSD", sparse_mode=2, atten_mask=torch.ones(3, 3, dtype=torch.bool).triu(1))


def _device_selection(npu):
    from mindspeed_llm import device

    acc = device.accelerator()
    assert (acc.kind, acc.backend) == ("npu", "hccl")
    assert device.current_device() == torch.device("npu", 3)
    assert device.setup() is acc
    assert npu.count("transfer_to_npu") == 1 and npu.last("set_device")["args"] == (3,)
    assert torch.cuda.current_device is torch.npu.current_device  # transfer_to_npu's redirection
    assert torch.cuda.current_device() == 3
    from torch.utils import _triton

    assert _triton.has_triton() is False


def test_device_selection_and_backend_with_the_stand_in():
    _in_fork(_device_selection)


def _rng_synchronize_profiler(npu):
    from mindspeed_llm import device

    device.manual_seed(7)
    state = device.rng_state()
    device.set_rng_state(state)
    device.synchronize()
    api, activities = device.profiler_api()
    counts = npu.counts()
    # manual_seed_all: device.manual_seed, and torch.manual_seed seeding the PrivateUse1 ("npu") module itself
    assert counts["manual_seed_all"] == 2 and counts["get_rng_state"] == 1 and counts["set_rng_state"] == 1
    assert counts["synchronize"] == 1
    assert api is sys.modules["torch_npu"].profiler and activities == [api.ProfilerActivity.CPU,
                                                                        api.ProfilerActivity.NPU]


def test_rng_synchronize_and_profiler_go_through_torch_npu():
    _in_fork(_rng_synchronize_profiler)


def test_nothing_of_torch_npu_is_left_after_the_block():
    from tests.helpers.fixtures_data import run_forked

    def child():
        from mindspeed_llm import device

        cuda_current_device, init = torch.cuda.current_device, torch.distributed.init_process_group
        with installed():
            from torch_npu.contrib import transfer_to_npu  # noqa: F401

            assert "torch_npu" in sys.modules and hasattr(torch, "npu") and torch.cuda.current_device is not \
                cuda_current_device
        assert not any(name.split(".")[0] == "torch_npu" for name in sys.modules)
        assert not hasattr(torch, "npu") and torch.cuda.current_device is cuda_current_device
        assert torch.distributed.init_process_group is init and not device._npu_available()
        return 0

    status, stderr = run_forked(child)
    assert status == 0, stderr[-4000:]
