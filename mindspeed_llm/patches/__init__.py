"""The ONLY place that monkeypatches `megatron.core` (and the `torch.cuda` names it calls).

Each patch is a `Patch`: the dotted target it replaces, a factory for the replacement, the reason, and the
devices it applies to. `mindspeed_llm.device.setup()` applies the registry once per process;
`remove_patches()` restores every original (the tests use it to show that each patch is needed).

On NPU `torch_npu`'s own `transfer_to_npu` redirection does the device work. On CPU the patches in `cpu.py`
answer megatron-core 0.16.1's hard-coded `torch.cuda` calls. On every device: `inference.py` holds exact speed
patches of the decode step; `mla.py` lets multi-latent attention (DeepSeek-V3) build on the local spec; `moe.py`
mends two spots of megatron's MoE code that assume Transformer Engine or CUDA tensors (one of them CPU only);
`recompute.py` gives a recomputed region its micro-batch's per-forward settings and block recompute its padding
mask; `optimizer.py` lets the distributed optimizer, gradient clipping and bf16 / fp16 training take CPU and NPU
tensors and mends two of the distributed optimizer's checkpoint paths (a param group mixing fp32 and bf16
parameters; loading with torch Adam's `step`), those two on every device, CUDA included; `initialization.py` marks the tensor-parallel weights of models built without random initialisation as
megatron marks those it draws; `sequence_parallel.py` lets the local spec's torch norms run under
`--sequence-parallel`. `trainer_world.py` lays megatron's groups over the trainer ranks of a world whose last ranks
generate (asynchronous RL's placement). `rotary.py` (CPU) takes the rotary table's cos / sin once per forward instead of once per
query / key call and drops a copy (same results). `static_decode.py` holds the patches the CUDA-graph decode engine
installs on demand (only when it runs; see that module).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, List, Tuple


@dataclass(frozen=True)
class Patch:
    target: str  # dotted path of the attribute replaced, e.g. "torch.cuda.current_device"
    make: Callable[[Any], Any]  # original -> replacement
    reason: str
    devices: Tuple[str, ...]


_REGISTRY: List[Patch] = []
_APPLIED: List[Tuple[Any, str, Any, str]] = []  # (owner, attribute, original, target)


def register(target: str, reason: str, devices: Tuple[str, ...] = ("cpu",)):
    """Decorator: register `make(original) -> replacement` as the patch of `target`."""

    def wrap(make):
        _REGISTRY.append(Patch(target, make, reason, tuple(devices)))
        return make

    return wrap


def _resolve_owner(target: str):
    """Split 'a.b.c.attr' into (object owning attr, 'attr'), importing the longest module prefix."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise ImportError(f"cannot resolve patch target {target!r}")


def registry() -> List[Patch]:
    _load_patch_modules()
    return list(_REGISTRY)


def _load_patch_modules():
    from mindspeed_llm.patches import (  # noqa: F401  (registration happens at import)
        cpu, fused_ops, inference, initialization, mla, moe, optimizer, recompute, rotary, sequence_parallel,
        trainer_world)


def apply_patches(device_kind: str) -> List[str]:
    """Apply every registered patch for `device_kind` (idempotent). Returns the targets patched."""
    _load_patch_modules()
    done = {target for _, _, _, target in _APPLIED}
    for patch in _REGISTRY:
        if device_kind not in patch.devices or patch.target in done:
            continue
        owner, attr = _resolve_owner(patch.target)
        original = getattr(owner, attr, None)
        setattr(owner, attr, patch.make(original))
        _APPLIED.append((owner, attr, original, patch.target))
    return applied()


def applied() -> List[str]:
    return [target for _, _, _, target in _APPLIED]


def remove_patches() -> None:
    """Restore every original, newest first."""
    while _APPLIED:
        owner, attr, original, _ = _APPLIED.pop()
        setattr(owner, attr, original)
