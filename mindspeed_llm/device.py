"""The one place that knows about accelerators.

Picks Ascend NPU (when `torch_npu` imports and a device is present), else CUDA, else CPU; the matching
collective backend (hccl / nccl / gloo); and applies, once, the Megatron patches that device needs
(see `mindspeed_llm.patches`). Everything else asks this module for `current_device()` and never
branches on the accelerator itself.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch


@dataclass(frozen=True)
class Accelerator:
    kind: str  # "npu" | "cuda" | "cpu"
    backend: str  # "hccl" | "nccl" | "gloo"

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    @property
    def has_fused_torch_adam(self) -> bool:
        """torch.optim.Adam(W)(fused=True) has a kernel here (torch >= 2.4 on CPU and CUDA; not torch_npu)."""
        return self.kind in ("cpu", "cuda")


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception:
        return False
    return bool(getattr(torch, "npu", None)) and torch.npu.is_available() and torch.npu.device_count() > 0


@lru_cache(maxsize=1)
def accelerator() -> Accelerator:
    """The accelerator of this process. `MINDSPEED_DEVICE=cpu|cuda|npu` forces a choice (for tests)."""
    forced = os.environ.get("MINDSPEED_DEVICE", "").strip().lower()
    if forced:
        if forced not in ("cpu", "cuda", "npu"):
            raise ValueError(f"MINDSPEED_DEVICE={forced!r}: expected one of cpu, cuda, npu")
        return Accelerator(forced, {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[forced])
    if _npu_available():
        return Accelerator("npu", "hccl")
    if torch.cuda.is_available():
        return Accelerator("cuda", "nccl")
    return Accelerator("cpu", "gloo")


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def current_device() -> torch.device:
    acc = accelerator()
    if acc.is_cpu:
        return torch.device("cpu")
    return torch.device(acc.kind, local_rank())


def synchronize() -> None:
    """Wait for queued device work, so that timers measure it (no-op on CPU)."""
    acc = accelerator()
    if acc.kind == "cuda":
        torch.cuda.synchronize()
    elif acc.kind == "npu":
        torch.npu.synchronize()


def host_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` bytes (uint8) of host memory for copies of device tensors: pinned on an accelerator, so that the
    copies can run asynchronously (`non_blocking=True`) at full bandwidth; plain memory on the CPU (nothing to pin
    for)."""
    return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=not accelerator().is_cpu)


def manual_seed(seed: int) -> None:
    """Seed python, numpy, torch (CPU) and the accelerator's generators."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    acc = accelerator()
    if acc.kind == "cuda":
        torch.cuda.manual_seed_all(seed)
    elif acc.kind == "npu":
        torch.npu.manual_seed_all(seed)


def rng_state():
    """The accelerator's default generator state (None on CPU: the CPU generator is saved on its own)."""
    acc = accelerator()
    if acc.kind == "cuda":
        return torch.cuda.get_rng_state()
    if acc.kind == "npu":
        return torch.npu.get_rng_state()
    return None


def set_rng_state(state) -> None:
    acc = accelerator()
    if state is None or acc.is_cpu:
        return
    (torch.cuda if acc.kind == "cuda" else torch.npu).set_rng_state(state)


_SETUP_DONE = False


def setup() -> Accelerator:
    """Select the device for this process and apply the Megatron patches it needs. Idempotent."""
    global _SETUP_DONE
    acc = accelerator()
    if not _SETUP_DONE:
        if acc.kind == "cuda":
            torch.cuda.set_device(local_rank())
        elif acc.kind == "npu":
            # torch_npu's own redirection of torch.cuda.* to the NPU; no Megatron patch of ours is needed.
            from torch_npu.contrib import transfer_to_npu  # noqa: F401

            torch.npu.set_device(local_rank())
        from mindspeed_llm import patches

        patches.apply_patches(acc.kind)
        _SETUP_DONE = True
    return acc
