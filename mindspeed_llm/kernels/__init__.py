"""Optional accelerator kernels, and the one place that chooses between them and the device-agnostic torch paths.

Three families, each with its environment variable (``auto`` | ``torch`` | ``triton``):

* ``logprobs`` (``MINDSPEED_LOGPROBS_KERNEL``): :mod:`.triton_logprobs`, for ``rl.logprobs.vocab_parallel_logprobs``;
  ``auto`` picks it on CUDA only.
* ``scans`` (``MINDSPEED_SCAN_KERNEL``): :mod:`.triton_scans`, GAE and the discounted returns of REINFORCE++ for
  ``core_algos.scans``;
* ``losses`` (``MINDSPEED_LOSS_KERNEL``): :mod:`.triton_rl_losses`, the fused clipped policy and value losses for
  ``core_algos.losses``.

``auto`` picks the Triton kernel on CUDA when Triton imports, and (scans and losses) on Ascend NPUs when the Triton
package there is Triton-Ascend (its ``triton.backends.ascend`` backend is installed); the torch path elsewhere (CPU;
NPU without Triton-Ascend). On an NPU the scan and loss kernels launch as Triton-Ascend's porting rules ask
(:mod:`.launch`: a 1-D grid of the vector-core count, 32-byte tiles that fit the unified buffer); they have never run
on an NPU: that choice is unverified until they do. :mod:`.fused_ops` holds the plain-torch RMSNorm and SwiGLU of
the --use-fused-* flags off the NPU.
``torch`` always takes the torch path; ``triton`` always the kernel (an error where it cannot run; on CPU it runs
only under ``TRITON_INTERPRET=1``, for tests).

Nothing here imports Triton: the checks only look the packages up, so CPU and NPU installs without Triton never
load it.
"""

from __future__ import annotations

import functools
import importlib.util
import os

__all__ = [
    "KERNEL_ENVS", "KERNEL_CHOICES", "LOGPROBS_KERNEL_ENV", "LOGPROBS_KERNELS", "select_kernel",
    "select_logprobs_kernel", "triton_available", "triton_ascend_available", "triton_interpreter",
]

KERNEL_CHOICES = ("auto", "torch", "triton")
KERNEL_ENVS = {"logprobs": "MINDSPEED_LOGPROBS_KERNEL", "scans": "MINDSPEED_SCAN_KERNEL",
               "losses": "MINDSPEED_LOSS_KERNEL"}
# What the error messages call a family's kernel and the tensors it is given.
_NAMES = {"logprobs": ("log-prob kernel", "logits"), "scans": ("scan kernel", "rewards"),
          "losses": ("loss kernel", "log-probs / values")}
# Devices where `auto` takes the Triton kernel (npu: with Triton-Ascend).
_AUTO_DEVICES = {"logprobs": ("cuda",), "scans": ("cuda", "npu"), "losses": ("cuda", "npu")}

LOGPROBS_KERNEL_ENV = KERNEL_ENVS["logprobs"]
LOGPROBS_KERNELS = KERNEL_CHOICES


@functools.lru_cache(maxsize=None)  # called on every kernel call on an accelerator: look the package up once
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def triton_ascend_available() -> bool:
    """Triton-Ascend installs itself as the ``triton`` package with an ``ascend`` backend (unverified here: no
    NPU or Triton-Ascend install was available)."""
    if not triton_available():
        return False
    try:
        return importlib.util.find_spec("triton.backends.ascend") is not None
    except (ImportError, ValueError):
        return False


def triton_interpreter() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels in numpy on CPU tensors (tests only; decided when a kernel
    is defined, i.e. when its module under mindspeed_llm.kernels is first imported)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _triton_runs_on(device_type: str) -> bool:
    if device_type == "cuda":
        return triton_available()
    if device_type == "npu":
        return triton_ascend_available()
    return False


def select_kernel(family: str, device, kernel=None) -> str:
    """``"triton"`` or ``"torch"``: which implementation of ``family`` (a key of ``KERNEL_ENVS``) runs for tensors
    on ``device``. ``kernel`` (else the family's environment variable, else ``"auto"``) is one of
    ``KERNEL_CHOICES``."""
    env = KERNEL_ENVS[family]
    what, inputs = _NAMES[family]
    choice = kernel if kernel is not None else os.environ.get(env, "auto")
    choice = str(choice).strip().lower() or "auto"
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{env}={choice!r} is not a {what}: use one of {', '.join(KERNEL_CHOICES)}")
    device_type = getattr(device, "type", str(device))
    if choice == "torch":
        return "torch"
    if choice == "auto":
        return "triton" if device_type in _AUTO_DEVICES[family] and _triton_runs_on(device_type) else "torch"
    if not triton_available():
        raise RuntimeError(
            f"{env}=triton, but Triton is not installed: `pip install triton` "
            f"(it comes with CUDA builds of torch; Triton-Ascend on NPUs), or set {env}=torch"
        )
    runs_here = device_type == "cuda" or (device_type == "npu" and family != "logprobs")
    if not runs_here and not (device_type == "cpu" and triton_interpreter()):
        where = "CUDA devices" if family == "logprobs" else "CUDA devices (Ascend NPUs with Triton-Ascend)"
        raise RuntimeError(
            f"{env}=triton, but the {inputs} are on {device_type!r}: the Triton kernel runs on {where} "
            f"(or on CPU under TRITON_INTERPRET=1, for tests); set {env}=auto or torch"
        )
    return "triton"


def select_logprobs_kernel(device, kernel=None) -> str:
    """``"triton"`` or ``"torch"``: which implementation ``vocab_parallel_logprobs`` runs for logits on
    ``device`` (:func:`select_kernel` of the ``logprobs`` family, ``MINDSPEED_LOGPROBS_KERNEL``)."""
    return select_kernel("logprobs", device, kernel)
