"""Optional accelerator kernels, and the choice between them and the device-agnostic torch paths.

Nothing here imports Triton at import time: :func:`select_logprobs_kernel` only checks whether it
could be imported, so CPU and NPU installs without Triton never load it.
"""

from __future__ import annotations

import functools
import importlib.util
import os

__all__ = ["LOGPROBS_KERNEL_ENV", "LOGPROBS_KERNELS", "select_logprobs_kernel", "triton_available", "triton_interpreter"]

# auto: the Triton kernel on CUDA devices when Triton imports, the chunked torch path elsewhere (CPU, NPU);
# torch: always the chunked torch path; triton: always the Triton kernel (an error where it cannot run).
LOGPROBS_KERNEL_ENV = "MINDSPEED_LOGPROBS_KERNEL"
LOGPROBS_KERNELS = ("auto", "torch", "triton")


@functools.lru_cache(maxsize=None)  # called on every log-prob call on CUDA: look the package up once
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreter() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels in numpy on CPU tensors (tests only; decided when a kernel
    is defined, i.e. when mindspeed_llm.kernels.triton_logprobs is first imported)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def select_logprobs_kernel(device, kernel=None) -> str:
    """``"triton"`` or ``"torch"``: which implementation ``vocab_parallel_logprobs`` runs for logits on
    ``device``. ``kernel`` (else the ``MINDSPEED_LOGPROBS_KERNEL`` environment variable, else ``"auto"``)
    is one of ``auto``, ``torch``, ``triton``."""
    choice = kernel if kernel is not None else os.environ.get(LOGPROBS_KERNEL_ENV, "auto")
    choice = str(choice).strip().lower() or "auto"
    if choice not in LOGPROBS_KERNELS:
        raise ValueError(
            f"{LOGPROBS_KERNEL_ENV}={choice!r} is not a log-prob kernel: use one of {', '.join(LOGPROBS_KERNELS)}"
        )
    device_type = getattr(device, "type", str(device))
    if choice == "torch":
        return "torch"
    if choice == "auto":
        return "triton" if device_type == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError(
            f"{LOGPROBS_KERNEL_ENV}=triton, but Triton is not installed: `pip install triton` "
            f"(it comes with CUDA builds of torch), or set {LOGPROBS_KERNEL_ENV}=torch"
        )
    if device_type != "cuda" and not (device_type == "cpu" and triton_interpreter()):
        raise RuntimeError(
            f"{LOGPROBS_KERNEL_ENV}=triton, but the logits are on {device_type!r}: the Triton kernel runs on CUDA "
            f"devices (or on CPU under TRITON_INTERPRET=1, for tests); set {LOGPROBS_KERNEL_ENV}=auto or torch"
        )
    return "triton"
