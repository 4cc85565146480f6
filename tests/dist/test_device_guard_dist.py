"""The CPU device guard (`tests/helpers/device_guard.py`) on megatron: a tiny GPTModel, DDP and the project's CPU
patches applied inside the guard, in a spawned process so that the patches do not leak into other tests. The
plain torch cases: tests/unit/test_device_guard.py.
"""

import os

import pytest
import torch
import torch.distributed as dist
from tests.helpers.device_guard import DEVICE, DeviceMixError, virtual_device  # noqa: E402
from tests.helpers.multiproc import run_distributed  # noqa: E402

from mindspeed_llm import device  # noqa: E402

pytestmark = pytest.mark.usefixtures("warm_ranks")  # the module's bodies share processes


def _megatron_worker(rank, world_size):
    os.environ["MINDSPEED_DEVICE"] = "cpu"
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from mindspeed_llm import distributed, patches
    from mindspeed_llm.models import ArchitectureSpec, build_model

    spec = ArchitectureSpec(family="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                            num_query_groups=2, kv_channels=16, vocab_size=256)
    out = {}
    with virtual_device() as vd:
        # The project's CPU patches get applied inside the block; the guard's overrides stay on top.
        distributed.initialize(1, 1, seed=0)
        out["cuda_current_device_inside"] = str(torch.cuda.current_device())
        tokens = torch.randint(0, 256, (2, 8), device=device.current_device())
        positions = torch.arange(8, device=device.current_device()).unsqueeze(0).expand(2, 8)
        model = build_model(spec)
        try:
            model(tokens, positions, None)
            out["unmoved"] = "no error"
        except DeviceMixError as exc:
            out["unmoved"] = str(exc).splitlines()[0]
        model.to(device.current_device())
        ddp = DistributedDataParallel(config=model.config, ddp_config=DistributedDataParallelConfig(), module=model)
        logits = ddp(tokens, positions, None)
        logits.float().logsumexp(-1).mean().backward()
        ddp.finish_grad_sync()
        out["logits"] = vd.location(logits)
        out["main_grads"] = sorted({vd.location(p.main_grad) for p in model.parameters()})
        out["grad_norm"] = float(sum(p.main_grad.norm() ** 2 for p in model.parameters()))
        out["ops"] = vd.ops_seen
    out["cuda_current_device_after"] = str(torch.cuda.current_device())  # the project's patch, not the guard's
    out["recorded_originals"] = [str(getattr(original, "__qualname__", original)) for _, _, original, target
                                 in patches._APPLIED if target == "torch.cuda.current_device"]
    return out


def test_tiny_megatron_model_under_the_guard():
    (out,) = run_distributed(_megatron_worker, 1)
    assert out["cuda_current_device_inside"] == "meta"
    assert out["unmoved"] == "host/device mix in aten.embedding.default (called as torch.nn.functional.embedding)"
    assert out["logits"] == DEVICE and out["main_grads"] == [DEVICE]  # DDP hooks, grad buffers: no false mix
    assert out["grad_norm"] > 0 and out["ops"] > 100
    assert out["cuda_current_device_after"] == "cpu"
    assert out["recorded_originals"] and "_marker_device" not in out["recorded_originals"][0]
