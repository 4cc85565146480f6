"""tests/helpers/device_guard.py: the CPU guard that gives tensors a virtual host/device location and raises on a mix.

Plain torch cases run in this process (a 1-process gloo group for the collectives); the megatron case:
tests/dist/test_device_guard_dist.py.
"""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tests.helpers.device_guard import DEVICE, HOST, MARKER, DeviceMixError, virtual_device  # noqa: E402
from tests.helpers.ports import free_port  # noqa: E402

from mindspeed_llm import device  # noqa: E402


def dev():
    return device.current_device()


# ============================================================================ factories and mixing

def test_host_plus_device_raises_naming_the_op_and_the_line():
    with virtual_device():
        scores = torch.ones(3, device=dev())
        total = torch.zeros(3)  # the bug: a total made on the host
        with pytest.raises(DeviceMixError) as info:
            total + scores
    message = str(info.value)
    assert "aten.add.Tensor" in message and "torch.Tensor.add" in message
    assert "host   shape=(3,)" in message and "device shape=(3,)" in message
    assert __file__ in message and "total + scores" in message  # the user stack points here


def test_factory_with_current_device_is_device_and_mixes_fine():
    with virtual_device() as vd:
        scores = torch.ones(3, device=dev())
        total = torch.zeros(3, device=dev())
        total += scores * 2
        assert vd.location(total) == DEVICE
        assert vd.location(torch.zeros(3)) == HOST
        assert vd.location(torch.zeros(3, device="cpu")) == HOST
        assert vd.location(torch.tensor([1.0, 2.0], device=dev())) == DEVICE
        assert vd.location(torch.arange(4, device="cuda")) == DEVICE  # 'cuda' counts as the accelerator
    assert total.tolist() == [2.0, 2.0, 2.0]


def test_a_correct_program_passes():
    with virtual_device() as vd:
        x = torch.randn(4, 5, device=dev())
        w = torch.randn(5, 3, device=dev())
        mask = torch.arange(4, device=dev()) < 2
        y = torch.where(mask[:, None], x @ w, 0.0)
        z = torch.cat([y, y.new_zeros(1, 3)]).softmax(-1).sum(0)
        assert vd.location(z) == DEVICE
        assert z.shape == (3,)
        # torch's C++ composites cast with the input's own options (`_to_copy(x, dtype=fp32, device=cpu)`
        # inside rms_norm): that is no move to the host
        h = torch.randn(2, 4, device=dev(), dtype=torch.bfloat16)
        normed = torch.nn.functional.rms_norm(h, (4,), torch.ones(4, device=dev(), dtype=torch.bfloat16))
        assert vd.location(normed @ torch.ones(4, 2, device=dev(), dtype=torch.bfloat16)) == DEVICE


def test_device_attribute_reads_as_the_marker_and_factories_inherit_it():
    with virtual_device() as vd:
        x = torch.ones(3, device=dev())
        h = torch.ones(3)
        assert x.device == MARKER and h.device == torch.device("cpu")
        assert vd.location(torch.zeros(2, device=x.device)) == DEVICE
        assert vd.location(torch.zeros(2, device=h.device)) == HOST
        assert vd.location(torch.zeros_like(x)) == DEVICE and vd.location(x.new_full((2,), 7.0)) == DEVICE
        assert vd.location(torch.empty_like(x, device="cpu")) == HOST


def test_torch_internal_code_sees_the_real_device():
    # torch.optim's fused AdamW refuses params whose device.type is not in its list ('meta' is not): inside
    # torch the device of a device tensor reads as the real CPU.
    with virtual_device() as vd:
        p = torch.nn.Parameter(torch.ones(4, device=dev()))
        opt = torch.optim.AdamW([p], lr=0.1, fused=True)
        (p * p).sum().backward()
        opt.step()
        assert vd.location(p) == DEVICE and vd.location(opt.state[p]["exp_avg"]) == DEVICE
    assert p.detach().lt(1).all()


def test_zero_dim_host_tensors_are_exempt():
    with virtual_device() as vd:
        d = torch.ones(3, device=dev())
        assert vd.location(d * torch.tensor(2.0)) == DEVICE  # a CPU scalar: CUDA takes it
        with pytest.raises(DeviceMixError, match="aten.add.Tensor"):
            d + torch.ones(1)  # one element, but not 0-dim
        with pytest.raises(DeviceMixError, match="aten.add.Tensor"):
            torch.tensor(2.0, device=dev()) + torch.ones(3)  # a device scalar with a host vector: CUDA refuses


# ============================================================================ views, copies, moves

def test_views_copies_and_indexing_keep_their_location():
    with virtual_device() as vd:
        d = torch.arange(6.0, device=dev()).reshape(2, 3)
        h = torch.zeros(2, 3)
        for t in (d.t(), d[0], d[:, 1:], d.data, d.detach(), d.clone(), d.view(6), torch.nn.Parameter(d)):
            assert vd.location(t) == DEVICE
        d.add_(1)
        assert vd.location(d) == DEVICE
        assert vd.location(d[torch.tensor([1, 0])]) == DEVICE  # host indices into a device tensor: allowed
        d[torch.tensor([0])] = 5.0
        h[0:1] = d[0:1]  # a copy between locations: allowed
        assert vd.location(h) == HOST
        with pytest.raises(DeviceMixError, match="aten.index.Tensor"):
            h[torch.tensor([1], device=dev())]
        with pytest.raises(DeviceMixError, match="aten.cat"):
            torch.cat([d, h])
        with pytest.raises(DeviceMixError, match="aten.where"):
            torch.where(d > 0, d, h)
        with pytest.raises(DeviceMixError, match="aten.index_put"):
            d[torch.tensor([0])] = torch.ones(1, 3)  # values must be on self's device


def test_moves_copy_between_locations():
    with virtual_device() as vd:
        d = torch.ones(3, device=dev())
        h = torch.ones(3)
        back = d.cpu()
        assert vd.location(back) == HOST and vd.location(d) == DEVICE
        assert back.untyped_storage().data_ptr() != d.untyped_storage().data_ptr()  # a real copy
        assert vd.location(d.to("cpu")) == HOST
        up = h.cuda()
        assert vd.location(up) == DEVICE and vd.location(h) == HOST
        assert vd.location(h.to(dev())) == DEVICE and vd.location(h.to(device=dev(), dtype=torch.float64)) == DEVICE
        assert d.to(dev()) is d  # already there: torch returns the tensor itself
        assert vd.location(h.to(d)) == DEVICE and vd.location(d.to(h)) == HOST
        assert vd.location(d.to(torch.float64)) == DEVICE
        moved = torch.as_tensor(h, device=dev())
        assert vd.location(moved) == DEVICE and vd.location(h) == HOST


def test_module_to_current_device_tags_parameters_and_buffers():
    with virtual_device() as vd:
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        tensors = list(model.parameters()) + list(model.buffers())
        assert {vd.location(t) for t in tensors} == {HOST}  # built without a device: host until moved
        with pytest.raises(DeviceMixError):
            model(torch.ones(2, 4, device=dev()))
        model.to(dev())
        tensors = list(model.parameters()) + list(model.buffers())
        assert {vd.location(t) for t in tensors} == {DEVICE}
        model(torch.ones(2, 4, device=dev())).sum().backward()
        assert {vd.location(p.grad) for p in model.parameters()} == {DEVICE}
        model.to("cpu")
        assert {vd.location(t) for t in model.parameters()} == {HOST}


def test_embedding_of_a_module_never_moved_raises():
    """The bug this guard was written for: GPU generation died at the first forward."""
    with virtual_device():
        embedding = torch.nn.Embedding(10, 4)  # built on the host, never moved
        tokens = torch.tensor([[1, 2, 3]], device=dev())
        with pytest.raises(DeviceMixError, match="aten.embedding.default") as info:
            embedding(tokens)
        assert "torch.nn.functional.embedding" in str(info.value)
        embedding.to(dev())
        assert embedding(tokens).shape == (1, 3, 4)


def test_megatron_style_buffers_from_torch_cuda_current_device():
    with virtual_device() as vd:
        assert torch.cuda.current_device() == MARKER
        main_grad = torch.zeros(6, device=torch.cuda.current_device())  # megatron DDP's grad buffer
        param = torch.nn.Parameter(torch.ones(6, device=dev()))
        (param * 3).sum().backward()
        main_grad.add_(param.grad.data)
        assert vd.location(main_grad) == DEVICE and vd.location(param.grad) == DEVICE


# ============================================================================ autograd

class _HostAllocInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2 + torch.zeros(grad.shape)  # the bug: a host buffer in a backward


class _DeviceAllocInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2 + torch.zeros(grad.shape, device=grad.device)


def test_backward_code_is_checked_like_forward_code():
    with virtual_device() as vd:
        x = torch.ones(3, device=dev(), requires_grad=True)
        _DeviceAllocInBackward.apply(x).sum().backward()
        assert vd.location(x.grad) == DEVICE and x.grad.tolist() == [2.0, 2.0, 2.0]
        with pytest.raises(DeviceMixError, match="inside torch.autograd.backward") as info:
            torch.autograd.backward(_HostAllocInBackward.apply(x).sum())
        assert "aten.add.Tensor" in str(info.value) and "torch.zeros(grad.shape)" in str(info.value)


def test_record_mode_collects_each_mix_once():
    with virtual_device(on_mix="record") as vd:
        d = torch.ones(3, device=dev())
        for _ in range(3):
            d + torch.ones(3)
        d * torch.ones(3)
    assert [m["op"] for m in vd.mixes] == ["aten.add.Tensor", "aten.mul.Tensor"]
    assert all(m["kind"] == "host/device mix" for m in vd.mixes)


def test_numpy_of_a_device_tensor_raises():
    with virtual_device():
        d = torch.ones(3, device=dev())
        with pytest.raises(DeviceMixError, match="numpy"):
            d.numpy()
        with pytest.raises(DeviceMixError, match="numpy"):
            np.asarray(d)
        assert d.cpu().numpy().tolist() == [1.0, 1.0, 1.0]
        assert torch.ones(2).numpy().shape == (2,)


# ============================================================================ collectives

@pytest.fixture
def gloo_group():
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:.*all_gather_into_tensor.*:FutureWarning")  # megatron still calls it
def test_collectives_need_device_tensors(gloo_group):
    with virtual_device():
        buffer = torch.ones(4, device=dev())
        dist.broadcast(buffer, src=0)
        dist.all_reduce(buffer)
        gathered = torch.empty(4, device=dev())
        dist.all_gather_into_tensor(gathered, buffer)
        with pytest.raises(DeviceMixError, match="c10d.broadcast_") as info:
            dist.broadcast(torch.empty(4), src=0)  # the bug: a pipeline buffer made on the host
        assert "host tensor in a collective" in str(info.value) and "broadcast" in str(info.value)
        with pytest.raises(DeviceMixError, match="c10d.allreduce_"):
            dist.all_reduce(torch.zeros(2))  # a metrics reduction on the host
        with pytest.raises(DeviceMixError, match="c10d"):
            dist.all_gather_into_tensor(torch.empty(4), buffer)


def test_object_collectives_do_not_trip(gloo_group):
    with virtual_device():
        out = [None]
        dist.all_gather_object(out, {"rank": 0})
        box = ["payload"]
        dist.broadcast_object_list(box, src=0)
        dist.barrier()
    assert out == [{"rank": 0}] and box == ["payload"]


# ============================================================================ set-up and tear-down

def test_current_device_is_patched_only_inside_and_restored_also_on_errors():
    before = (device.current_device, torch.cuda.current_device, vars(torch.Tensor).get("cuda"))
    real = device.current_device()
    with virtual_device():
        assert device.current_device() == MARKER and torch.cuda.current_device() == MARKER
    assert (device.current_device, torch.cuda.current_device, vars(torch.Tensor).get("cuda")) == before
    with pytest.raises(ValueError, match="boom"):
        with virtual_device():
            raise ValueError("boom")
    assert (device.current_device, torch.cuda.current_device, vars(torch.Tensor).get("cuda")) == before
    with pytest.raises(DeviceMixError):
        with virtual_device():
            torch.ones(2, device=dev()) + torch.ones(2)
    assert (device.current_device, torch.cuda.current_device, vars(torch.Tensor).get("cuda")) == before
    assert device.current_device() == real
    assert torch.zeros(1, device="meta").is_meta  # the modes are gone: 'meta' is plain meta again
    with virtual_device():  # and a new block starts clean
        assert torch.zeros(1, device=dev()).device == MARKER


def test_blocks_do_not_nest():
    with virtual_device():
        with pytest.raises(RuntimeError, match="do not nest"):
            with virtual_device():
                pass


# ============================================================================ megatron (spawned process)
