"""The CPU patches (mindspeed_llm/patches/cpu.py) are needed and sufficient for megatron-core 0.16.1 on CPU.

Each mode runs in its own subprocess (this file run as a script) so that patch state never leaks:

- needed: for each step of a training iteration (megatron's `model_parallel_cuda_manual_seed`, wrapping
  the GPTModel in megatron's DDP, forward, Megatron optimizer step with grad clipping) the prerequisites
  run patched, then `remove_patches()` is called and the step alone must fail with torch's CUDA error
  (the backward pass alone is the one step that runs unpatched);
- sufficient: with the patches, the same iteration runs and matches `transformers` + `torch.optim.AdamW`
  on the same weights: logits, loss, the clipped gradient norm, and the weights and loss after the step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# What torch raises for a torch.cuda call on a machine without CUDA: a CPU build, or a CUDA build without a driver.
CUDA_ERRORS = ("Torch not compiled with CUDA enabled", "Found no NVIDIA driver")
LR, CLIP = 1e-3, 0.05


def _run_modes(*modes: str) -> dict:
    """Run each mode in its own fresh interpreter (concurrently); {mode: result dict}."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MINDSPEED_DEVICE="cpu", PYTHONWARNINGS="ignore")
    procs = {m: subprocess.Popen([sys.executable, os.path.join(HERE, "test_patches.py"), m], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for m in modes}
    results = {}
    for mode, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        results[mode] = json.loads(lines[-1][len("RESULT "):]) if proc.returncode == 0 and lines else (
            f"mode {mode} failed (rc={proc.returncode}):\n{err[-6000:]}")
    return results


@pytest.fixture(scope="module")
def modes():
    return _run_modes("needed", "sufficient")


@pytest.fixture
def needed(modes):
    assert isinstance(modes["needed"], dict), modes["needed"]
    return modes["needed"]


@pytest.fixture
def sufficient(modes):
    assert isinstance(modes["sufficient"], dict), modes["sufficient"]
    return modes["sufficient"]


# The backward pass itself (autograd + megatron DDP's grad hooks without overlap) runs unpatched, so it is
# recorded but not listed here.
@pytest.mark.parametrize("step", ["seed", "ddp_wrap", "forward", "optimizer_step"])
def test_patches_are_needed(needed, step):
    assert needed["patched_before"] > 0 and needed["patched_during"] == 0
    error = needed["steps"][step]
    assert error is not None, f"{step} ran without the CPU patches: this step does not need them"
    assert any(marker in error for marker in CUDA_ERRORS), f"{step} failed, but not with a CUDA error: {error}"


def test_patches_are_sufficient(sufficient):
    r = sufficient
    assert r["logits_diff"] <= 1e-5, r
    assert abs(r["loss"] - r["ref_loss"]) <= 1e-6, r
    assert abs(r["grad_norm"] - r["ref_grad_norm"]) <= 1e-5 * r["ref_grad_norm"], r
    assert r["ref_grad_norm"] > CLIP, "the test must exercise gradient clipping"
    assert r["fused_adam"] == ["AdamW", True], r  # megatron's torch fallback, run with torch's fused kernel
    assert r["weights_diff"] <= 1e-5, r  # 1% of the step size: Adam amplifies last-bit gradient noise
    assert r["weights_moved"] > 1e-4, r
    assert abs(r["loss_after"] - r["ref_loss_after"]) <= 1e-5, r
    assert r["loss_after"] < r["loss"]


# ------------------------------------------------------------------------------------------- subprocess body

def _setup():
    import torch.distributed as dist

    from tests.helpers.ports import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from mindspeed_llm import distributed

    distributed.initialize(1, 1, seed=1234)  # applies the CPU patches (device.setup)
    return dist


def _tiny_pair(tmp):
    """(megatron GPTModel, HF model) with the same random weights, via the converter and loader."""
    import torch

    from tests.helpers.hf_tiny import build_tiny
    from mindspeed_llm.checkpoint import convert_hf_to_mg, load_megatron_weights, load_spec
    from mindspeed_llm.models import build_model

    hf = build_tiny("qwen2", num_layers=2, seed=21)
    hf.save_pretrained(os.path.join(tmp, "hf"))
    convert_hf_to_mg(os.path.join(tmp, "hf"), os.path.join(tmp, "mg"), progress=False)
    model = build_model(load_spec(os.path.join(tmp, "mg")), params_dtype=torch.float32)
    load_megatron_weights(model, os.path.join(tmp, "mg"))
    return model, hf


def _batch():
    import torch

    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(3, 256, (2, 13), generator=gen)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    return ids, labels, pos


def _ddp(model):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)


def _optimizer(ddp):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, clip_grad=CLIP, bf16=False, fp16=False,
                             adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8)
    return get_megatron_optimizer(config, [ddp])


def _mode_needed(tmp):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from mindspeed_llm import patches

    _setup()
    model, _ = _tiny_pair(tmp)
    ids, labels, pos = _batch()
    result = {"patched_before": len(patches.applied()), "steps": {}}

    def without_patches(name, fn):
        patches.remove_patches()
        result["patched_during"] = len(patches.applied())
        try:
            fn()
            result["steps"][name] = None
        except Exception as err:  # noqa: BLE001 (the error is the result)
            result["steps"][name] = f"{type(err).__name__}: {err}"
        finally:
            patches.apply_patches("cpu")

    without_patches("seed", lambda: model_parallel_cuda_manual_seed(1234))
    model_parallel_cuda_manual_seed(1234)  # the failed call reset megatron's RNG tracker: restore it, patched
    without_patches("ddp_wrap", lambda: _ddp(model))
    ddp = _ddp(model)
    without_patches("forward", lambda: ddp(ids, pos, None, labels=labels))
    loss = ddp(ids, pos, None, labels=labels).mean()
    without_patches("backward", lambda: (loss.backward(), ddp.finish_grad_sync()))
    ddp.zero_grad_buffer()
    ddp(ids, pos, None, labels=labels).mean().backward()
    ddp.finish_grad_sync()
    optimizer = _optimizer(ddp)
    without_patches("optimizer_step", lambda: optimizer.step())
    return result


def _mode_sufficient(tmp):
    import torch
    import torch.nn.functional as F

    from mindspeed_llm import patches
    from mindspeed_llm.checkpoint import hf_mapping, megatron_names, sharding

    _setup()
    assert patches.applied()
    model, hf = _tiny_pair(tmp)
    ids, labels, pos = _batch()
    ddp = _ddp(model)
    optimizer = _optimizer(ddp)
    # The trainer's optimizer setting: torch's fused Adam kernel (compared below with HF + foreach AdamW).
    from mindspeed_llm.rl.update.trainable import use_fused_torch_adam

    use_fused_torch_adam(optimizer)
    inner = optimizer.optimizer

    with torch.no_grad():
        logits = ddp(ids, pos, None)
        ref_logits = hf(input_ids=ids).logits
    result = {"logits_diff": (logits - ref_logits).abs().max().item(),
              "fused_adam": [type(inner).__name__, all(g["fused"] for g in inner.param_groups)]}

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = ddp(ids, pos, None, labels=labels).mean()
    loss.backward()
    ddp.finish_grad_sync()
    ok, grad_norm, _ = optimizer.step()
    assert ok
    result.update(loss=loss.item(), grad_norm=float(grad_norm))

    hf.train()
    ref_opt = torch.optim.AdamW(hf.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    ref_loss = F.cross_entropy(hf(input_ids=ids).logits.reshape(-1, 256), labels.reshape(-1))
    ref_loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP)
    before = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    ref_opt.step()
    result.update(ref_loss=ref_loss.item(), ref_grad_norm=float(ref_norm))

    # compare weights after the step in HF names
    spec = model.model_spec
    full = {k: v for k, v in model.state_dict().items() if not sharding.is_extra_state(k)}
    converted = hf_mapping.mg_nonlayer_to_hf(full, spec, False)
    for i in range(spec.num_layers):
        layer = {rel: full[megatron_names.layer_key(i, rel)] for rel in megatron_names.mg_layer_names(spec)}
        converted.update(hf_mapping.mg_layer_to_hf(layer, spec, i))
    after = hf.state_dict()
    result["weights_diff"] = max((converted[k] - after[k]).abs().max().item() for k in converted)
    result["weights_moved"] = max((after[k] - before[k]).abs().max().item() for k in converted)
    with torch.no_grad():
        result["loss_after"] = ddp(ids, pos, None, labels=labels).mean().item()
        result["ref_loss_after"] = F.cross_entropy(hf(input_ids=ids).logits.reshape(-1, 256), labels.reshape(-1)).item()
    return result


def _main(mode: str) -> None:
    import tempfile

    sys.path.insert(0, ROOT)  # tests.helpers
    with tempfile.TemporaryDirectory() as tmp:
        result = {"needed": _mode_needed, "sufficient": _mode_sufficient}[mode](tmp)
    print("RESULT " + json.dumps(result), flush=True)
    from mindspeed_llm import distributed

    distributed.destroy()


if __name__ == "__main__":
    _main(sys.argv[1])
