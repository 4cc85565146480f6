"""The one place that knows about accelerators.

Picks Ascend NPU (when `torch_npu` imports and a device is present), else CUDA, else CPU; the matching
collective backend (hccl / nccl / gloo); applies, once, the Megatron patches that device needs
(see `mindspeed_llm.patches`); and runs the fused attention kernel of that device (`attention`: torch's
`scaled_dot_product_attention` on CPU / CUDA, `torch_npu.npu_fusion_attention` on NPU), which the core attention
of `mindspeed_llm.models.attention` calls; and names the fused ops of MindSpeed-LLM's --use-fused-* flags that this
device runs (`FUSED_OPS`, `fused_ops_here`; the RMSNorm: `rms_norm`). Everything else asks this module for
`current_device()` and never branches on the accelerator itself.
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


def machine_identity() -> dict:
    """What a run's floating-point bits depend on besides its inputs: torch's build, the device and processor kinds and
    the CPU threads (a rollout dump records it; a replay names what differs)."""
    kind = accelerator().kind
    if kind == "cuda":
        processor = torch.cuda.get_device_name(current_device())
    elif kind == "npu":
        processor = torch.npu.get_device_name(current_device())
    else:
        processor = _cpu_model()
    return {"torch": torch.__version__, "device": kind, "processor": processor, "threads": torch.get_num_threads()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


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


def profiler_api():
    """(module, activities) of this device's profiler: `torch.profiler` with CPU (+ CUDA) activities, or
    `torch_npu.profiler` with CPU + NPU (written from its documented API, unverified until run on an NPU). Both
    have `profile`, `schedule` and `tensorboard_trace_handler`."""
    acc = accelerator()
    if acc.kind == "npu":
        import torch_npu

        api = torch_npu.profiler
        return api, [api.ProfilerActivity.CPU, api.ProfilerActivity.NPU]
    api = torch.profiler
    return api, [api.ProfilerActivity.CPU] + ([api.ProfilerActivity.CUDA] if acc.kind == "cuda" else [])


def cuda_profiler_range(start: bool) -> bool:
    """nsys's capture range (`--capture-range=cudaProfilerApi`): cudaProfilerStart / Stop. False where there is
    none (not CUDA)."""
    if accelerator().kind != "cuda":
        return False
    (torch.cuda.cudart().cudaProfilerStart if start else torch.cuda.cudart().cudaProfilerStop)()
    return True


def record_memory_history(enabled: bool) -> bool:
    """Start (or stop) recording the CUDA allocator's history for a memory snapshot; False where there is none."""
    if accelerator().kind != "cuda":
        return False
    torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=100000)
    return True


def dump_memory_snapshot(path: str) -> bool:
    """Write the recorded allocator history to `path` (a pickle for pytorch.org/memory_viz); False off CUDA."""
    if accelerator().kind != "cuda":
        return False
    torch.cuda.memory._dump_snapshot(path)
    return True


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


# ---------------------------------------------------------------------------------------------- attention kernel
CAUSAL_VARIANTS = ("upper_left", "lower_right")
NPU_CAUSAL_MASK_SIZE = 2048  # torch_npu's compressed causal mask for sparse_mode 2 / 3 is [2048, 2048]
_NPU_CAUSAL_MASKS: dict = {}


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float,
              masked: "torch.Tensor | None" = None, causal: "str | None" = None, dropout_p: float = 0.0,
              fusion_attention=None) -> torch.Tensor:
    """Scaled dot-product attention on this device's kernel; the one place that picks it.

    `query` `[b, h, sq, d]`, `key` `[b, g, sk, d]`, `value` `[b, g, sk, dv]` (heads first, "BNSD"); `g` divides `h`
    and query head i reads key/value head `i // (h // g)` (grouped-query attention, as megatron's repeat_interleave),
    without copying the keys. Returns `[b, h, sq, dv]`.

    * `masked`: bool `[b or 1, 1, sq, sk]`, True = masked (megatron's convention); a query row that is masked
      everywhere attends to every key instead (megatron fills masked scores with -10000, which makes such a row a
      uniform average; kernels differ there: 0, NaN or uniform). Such rows are never read, but a NaN there would
      reach the real rows through later layers' values (0 x NaN).
    * `causal` (without `masked`): "upper_left", query i sees keys `<= i`; "lower_right", keys `<= i + sk - sq`
      (the last query sees every key: a block of queries that continues a prefix).
    * `value` of a head dim other than the key's (multi-latent attention: narrower) is zero-padded to the wider
      of the two (or query and key are) and the output sliced: exact, and it keeps the flash kernels, which want
      one head dim (CPU SDPA falls back to its math kernel, which saves the probabilities, otherwise).

    CPU and CUDA: `torch.nn.functional.scaled_dot_product_attention` (torch picks its flash / memory-efficient /
    math kernel; on CPU the flash kernel saves only q, k, v, out and the log-sum-exp for backward; dropout goes
    through its math kernel, `lower_right` through a `[sq, sk]` bool mask except on CUDA). NPU:
    `torch_npu.npu_fusion_attention`
    (`fusion_attention` overrides it, for tests) in the "BNSD" layout: `masked` as its `atten_mask` with
    `sparse_mode=0`, `upper_left` / `lower_right` as `sparse_mode` 2 / 3 with the compressed 2048 x 2048 causal
    mask, key/value heads fewer than query heads read natively, `keep_prob = 1 - dropout_p`. The NPU translation
    is written from torch_npu's documented signature and checked against SDPA on CPU with a stand-in
    (tests/dist/test_attention.py, and in both stages by the NPU lane, tests/dist/test_npu_lane.py); it is
    unverified until run on an NPU (scripts/npu_check.sh).
    """
    if causal is not None and causal not in CAUSAL_VARIANTS:
        raise ValueError(f"attention: causal={causal!r}; use one of {CAUSAL_VARIANTS} or None")
    if masked is not None:
        if causal is not None:
            raise ValueError("attention: give either an explicit mask or a causal variant, not both")
        if masked.dtype != torch.bool:
            masked = masked.bool()
        masked = masked & ~masked.all(dim=-1, keepdim=True)  # fully masked rows: see the docstring
    head_dim, value_dim = key.size(-1), value.size(-1)
    width = max(head_dim, value_dim)  # zeros add nothing to q.k (the scale is explicit) nor to the output's width
    if head_dim < width:
        query, key = (torch.nn.functional.pad(t, (0, width - head_dim)) for t in (query, key))
    if value_dim < width:
        value = torch.nn.functional.pad(value, (0, width - value_dim))
    if fusion_attention is not None or accelerator().kind == "npu":
        out = _npu_attention(query, key, value, scale, masked, causal, dropout_p, fusion_attention)
    else:
        out = _sdpa_attention(query, key, value, scale, masked, causal, dropout_p)
    return out[..., :value_dim] if out.size(-1) != value_dim else out


def _sdpa_attention(query, key, value, scale, masked, causal, dropout_p):
    import torch.nn.functional as F

    gqa = query.size(1) != key.size(1)
    if masked is not None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=~masked, dropout_p=dropout_p,
                                              scale=scale, enable_gqa=gqa)
    if causal == "lower_right" and query.size(2) != key.size(2):
        sq, sk = query.size(2), key.size(2)
        if accelerator().kind == "cuda":  # torch's flash / memory-efficient kernels take it without a mask
            from torch.nn.attention.bias import causal_lower_right

            keep = causal_lower_right(sq, sk)
        else:  # elsewhere torch would materialise this very [sq, sk] mask itself (one for all heads and rows)
            keep = torch.ones((sq, sk), dtype=torch.bool, device=query.device).tril(sk - sq)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=keep, dropout_p=dropout_p, scale=scale,
                                              enable_gqa=gqa)
    return F.scaled_dot_product_attention(query, key, value, is_causal=causal is not None, dropout_p=dropout_p,
                                          scale=scale, enable_gqa=gqa)


def _npu_causal_mask(device) -> torch.Tensor:
    """torch_npu's compressed causal mask (True above the diagonal), one per device."""
    mask = _NPU_CAUSAL_MASKS.get(device)
    if mask is None:
        mask = torch.ones((NPU_CAUSAL_MASK_SIZE, NPU_CAUSAL_MASK_SIZE), dtype=torch.bool, device=device).triu(1)
        _NPU_CAUSAL_MASKS[device] = mask
    return mask


def _npu_attention(query, key, value, scale, masked, causal, dropout_p, fusion_attention=None):
    """`torch_npu.npu_fusion_attention` with the arguments `attention` describes (unverified on an NPU)."""
    if fusion_attention is None:
        import torch_npu

        fusion_attention = torch_npu.npu_fusion_attention
    kwargs = dict(scale=float(scale), keep_prob=1.0 - float(dropout_p))
    if masked is not None:
        kwargs.update(atten_mask=masked, sparse_mode=0)  # B1SS / 11SS bool, True = not attended
    elif causal is not None:
        kwargs.update(atten_mask=_npu_causal_mask(query.device), sparse_mode=2 if causal == "upper_left" else 3)
    out = fusion_attention(query.contiguous(), key.contiguous(), value.contiguous(), query.size(1), "BNSD",
                           **kwargs)
    return out[0]


# ------------------------------------------------------------------- fused ops of the --use-fused-* flags
# MindSpeed-LLM's --use-fused-rmsnorm / --use-fused-swiglu / --use-fused-rotary-pos-emb (`FUSED_OPS` names them):
# models built with one run the device's fused op instead of megatron's composite torch ops. The norm is
# `rms_norm` below (the built model's RMSNorms call it, `models/fused_ops.py`); SwiGLU and RoPE are megatron's own
# fusion switches, whose kernels `patches/fused_ops.py` provides per device. NPU: torch_npu's fused kernels
# (written from torch_npu's documented API; checked on CPU against plain-torch references of those ops,
# kernels/npu_reference.py; unverified until run on an NPU). CUDA: torch's `rms_norm` (the call torch's
# RMSNorm module already makes, fused there by recent torch: no change expected; unverified, no GPU run), SwiGLU as on
# the CPU. CPU: megatron's math with a hand-written backward that saves what the fused kernels save
# (`kernels/fused_ops.py`): a memory switch there (measured: benchmarks/README.md). RoPE: NPU only
# (`fused_ops_here`).
FUSED_OPS = {"rmsnorm": "--use-fused-rmsnorm", "swiglu": "--use-fused-swiglu", "rope": "--use-fused-rotary-pos-emb"}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x**2, -1) + eps) * weight` on this device's fused RMSNorm (see above)."""
    kind = accelerator().kind
    if kind == "npu":
        import torch_npu

        return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]
    if kind == "cuda":
        return torch.nn.functional.rms_norm(x, (x.size(-1),), weight, eps)
    from mindspeed_llm.kernels.fused_ops import lean_rms_norm

    return lean_rms_norm(x, weight, eps)


def fused_ops_here() -> tuple:
    """The `FUSED_OPS` this device runs: all three on NPU; no RoPE elsewhere (torch has no fused RoPE, and megatron's
    unfused one already saves only cos / sin for backward: its flag is listed as ignored there)."""
    return tuple(FUSED_OPS) if accelerator().kind == "npu" else ("rmsnorm", "swiglu")


NO_FUSED_ROPE = ("no fused RoPE off the NPU (torch has none; megatron's unfused RoPE already saves only cos / sin "
                 "for backward)")


def fused_ops_line(ops) -> str:
    """What runs the fused ops `ops` (`FUSED_OPS` names) on this device, for the startup notes."""
    kind = accelerator().kind
    lean = {"rmsnorm": "an RMSNorm that saves its input and rstd only", "swiglu": "a SwiGLU that saves its input only"}
    kernels = {"npu": {"rmsnorm": "torch_npu.npu_rms_norm", "swiglu": "torch_npu.npu_swiglu",
                       "rope": "torch_npu.npu_rotary_position_embedding"},
               "cuda": dict(lean, rmsnorm="torch's rms_norm"), "cpu": lean}[kind]
    line = f"on {kind}: " + ", ".join(kernels[op] for op in ops)
    if "rope" in ops:
        line += " (multi-latent attention keeps megatron's unfused RoPE)"
    return line
