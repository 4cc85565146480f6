"""A CPU stand-in for `torch_npu`, so that the project's NPU branches run in the tests: `with installed() as npu: ...`.

vllm-ascend's way of testing without an NPU: a module registers as `torch_npu` and gives `torch.npu`, so that the
code takes its NPU branches on the CPU; here each fused op is a plain-torch reference written from the op's
documentation, and every call is recorded (`npu.calls`, `npu.count(name)`), so a test can assert which branches were
reached and with which arguments. It checks calls and the documented semantics, not the hardware.

    with installed() as npu:                      # MINDSPEED_DEVICE=npu, or device._npu_available() sees it
        ...                                       # (tensors: inside `device_guard.virtual_device()`, see below)
    npu.count("npu_fusion_attention"), npu.last("set_device")

What it provides while installed (and takes back on exit; a process sees `torch_npu` only inside the block):

* `sys.modules["torch_npu"]` and its submodules; `torch.npu` (the same object as `torch_npu.npu`): `is_available`,
  `device_count`, `current_device` / `set_device`, `synchronize`, `empty_cache`, the memory statistics (zero),
  `mem_get_info`, the RNG (`manual_seed[_all]`, `seed`, `initial_seed`, `get_rng_state` / `set_rng_state`,
  `default_generators`, the `random` submodule), streams and events as no-ops. The NPU generator *is* the CPU default
  generator (as the CPU patches treat "cuda"), so an NPU run draws what the CPU run draws.
* `torch_npu.contrib.transfer_to_npu`: importing it does what torch_npu's does to the names the project and
  megatron-core use: the names of `torch.npu` (and `torch.npu.random`) are copied onto `torch.cuda` (and
  `torch.cuda.random`), as torch_npu's `_apply_patches` does with a patch module's `__all__`; `Tensor.cuda` /
  `Module.cuda` move to the NPU, `init_process_group`'s "nccl" becomes "hccl", `torch.utils._triton.has_triton()`
  answers False. Not modelled: its rewriting of `device="cuda"` in torch's factories (the guard treats every
  non-CPU device as the accelerator anyway) and its switching off of `torch.jit.script`.
* `torch_npu.profiler`: `profile` (the documented keywords; `ProfilerActivity.NPU` dropped, the rest on
  `torch.profiler`), `schedule`, `tensorboard_trace_handler`, `ProfilerActivity`, `ProfilerAction`.
* The fused ops: `npu_fusion_attention` (`FusionAttention`, below), and `npu_rms_norm`, `npu_swiglu`,
  `npu_rotary_position_embedding` from `mindspeed_llm/kernels/npu_reference.py`, each recording its call.
* `torch.device("npu", i)` parses: the PrivateUse1 backend is renamed "npu" (once per process, by torch's
  `rename_privateuse1_backend`; it cannot be undone, and without torch_npu installed nothing else answers to it).

Tensors. There is no NPU memory: tensors stay on the CPU. Run the code inside `device_guard.virtual_device()`,
which reads every non-CPU device (here "npu:N") as the accelerator and marks those tensors "device", so that a host /
device mix still fails as it would on an NPU. Outside the guard a tensor made with `device="npu"` fails (nothing
implements the PrivateUse1 backend), which keeps the stand-in from hiding a missing guard.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections import Counter
from typing import Any, Dict, List, Optional

import torch

from mindspeed_llm.kernels import npu_reference as npu_fused_reference
from mindspeed_llm.patches.cpu import NullEvent, NullStream

__all__ = ["NpuStandIn", "FusionAttention", "installed", "ensure_npu_device_name"]

DEVICE_COUNT = 8
NPU_CAUSAL_MASK_SIZE = 2048
_ACTIVE: Optional["NpuStandIn"] = None


def ensure_npu_device_name() -> None:
    """Make `torch.device("npu")` parse (torch's PrivateUse1 backend renamed "npu"; idempotent, permanent)."""
    name = torch._C._get_privateuse1_backend_name()
    if name == "npu":
        return
    if name not in ("privateuse1", "privateuseone"):  # torch's default name
        raise RuntimeError(f"the PrivateUse1 backend is already named {name!r}; the NPU stand-in needs it as 'npu'")
    torch.utils.rename_privateuse1_backend("npu")
    # `Tensor.is_npu` / `Tensor.npu` as torch_npu has them (torch.overrides lists `is_<backend>` once renamed)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=False, for_storage=False,
                                                         for_packed_sequence=False)


# ============================================================================================ npu_fusion_attention

def _cumulative(lengths, name) -> List[int]:
    ends = [int(v) for v in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    if not ends or any(b < a for a, b in zip([0] + ends, ends)):
        raise ValueError(f"npu_fusion_attention: {name} {ends} must be the non-decreasing cumulative ends of the "
                         "sequences (e.g. [3, 7] for lengths 3 and 4)")
    return ends


class FusionAttention:
    """`torch_npu.npu_fusion_attention` as documented, in plain torch, recording each call in `calls`.

    `(query, key, value, head_num, input_layout, *, pse, padding_mask, atten_mask, scale, keep_prob, pre_tockens,
    next_tockens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, gen_mask_parallel, sync)`
    -> `(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)`.

    * Layouts: "BNSD", "BSND", "BSH", "SBH" (H = heads x D; `head_num` = query heads) and "TND" (packed tokens of
      several sequences, `actual_seq_qlen` / `actual_seq_kvlen` their *cumulative* ends, e.g. lengths 3 and 4 as
      [3, 7]; each sequence attends only within itself). Key / value heads may be fewer than the query heads
      (grouped: query head i reads key head i // (heads / groups)); the value's head dim must equal the key's.
    * `atten_mask`: bool, True = not attended. `sparse_mode` 0: the mask as given (`[S_q, S_k]`, `[B, 1, S_q, S_k]`
      or `[1, 1, S_q, S_k]`), or none; 2 (left-up causal: query i sees keys <= i) and 3 (right-down causal: keys
      <= i + S_k - S_q) take the compressed 2048 x 2048 mask (True above the diagonal) and, under TND, apply to each
      sequence. Other modes, `pse`, `padding_mask` and `prefix` are refused (not modelled).
    * `keep_prob` < 1 (dropout) is refused: the kernel's dropout mask is its own RNG's, which nothing on the CPU can
      reproduce. `softmax_max` / `softmax_sum` are fp32 `[B, N, S_q, 8]` (the row max and the sum of exp, repeated),
      `[T, N, 8]` under TND; `softmax_out` is an empty tensor, `seed`, `offset`, `numels` 0.
    """

    LAYOUTS = ("BNSD", "BSND", "BSH", "SBH", "TND")

    def __init__(self, recorder: Optional["NpuStandIn"] = None):
        self.recorder = recorder
        self.calls: List[Dict[str, Any]] = []

    def __call__(self, query, key, value, head_num, input_layout, *, pse=None, padding_mask=None, atten_mask=None,
                 scale=1.0, keep_prob=1.0, pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
                 prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                 sync=False):
        call = dict(layout=input_layout, head_num=int(head_num), sparse_mode=sparse_mode, scale=float(scale),
                    keep_prob=float(keep_prob), q_shape=tuple(query.shape), k_shape=tuple(key.shape),
                    dtype=str(query.dtype).replace("torch.", ""),
                    mask_shape=None if atten_mask is None else tuple(atten_mask.shape),
                    actual_seq_qlen=None if actual_seq_qlen is None else _cumulative(actual_seq_qlen, "q"),
                    actual_seq_kvlen=None if actual_seq_kvlen is None else _cumulative(actual_seq_kvlen, "kv"),
                    contiguous=all(t.is_contiguous() for t in (query, key, value)))
        self.calls.append(call)
        if self.recorder is not None:
            self.recorder.record("npu_fusion_attention", **call)
        if input_layout not in self.LAYOUTS:
            raise ValueError(f"npu_fusion_attention: input_layout {input_layout!r} not one of {self.LAYOUTS}")
        if pse is not None or padding_mask is not None or prefix is not None:
            raise NotImplementedError("npu_fusion_attention stand-in: pse / padding_mask / prefix are not modelled")
        if keep_prob != 1.0:
            raise NotImplementedError("npu_fusion_attention stand-in: dropout (keep_prob < 1) is the kernel's own RNG")
        if sparse_mode not in (0, 2, 3):
            raise NotImplementedError(f"npu_fusion_attention stand-in: sparse_mode {sparse_mode} is not modelled")
        if atten_mask is not None and atten_mask.dtype != torch.bool:
            raise TypeError(f"npu_fusion_attention: atten_mask must be bool (True = masked), got {atten_mask.dtype}")
        if sparse_mode in (2, 3):
            if atten_mask is None or tuple(atten_mask.shape) != (NPU_CAUSAL_MASK_SIZE, NPU_CAUSAL_MASK_SIZE):
                raise ValueError(f"npu_fusion_attention: sparse_mode {sparse_mode} takes the compressed "
                                 f"{NPU_CAUSAL_MASK_SIZE} x {NPU_CAUSAL_MASK_SIZE} causal mask")
            expected = torch.ones(NPU_CAUSAL_MASK_SIZE, NPU_CAUSAL_MASK_SIZE, dtype=torch.bool,
                                  device=atten_mask.device).triu(1)
            if not torch.equal(atten_mask, expected):
                raise ValueError("npu_fusion_attention: the compressed causal mask must be True above the diagonal")
        if input_layout == "TND":
            return self._tnd(query, key, value, head_num, atten_mask, scale, sparse_mode, actual_seq_qlen,
                             actual_seq_kvlen)
        if actual_seq_qlen is not None or actual_seq_kvlen is not None:
            raise ValueError("npu_fusion_attention: actual_seq_qlen / actual_seq_kvlen go with input_layout 'TND'")
        if input_layout in ("BSH", "SBH"):
            if query.size(-1) % head_num:
                raise ValueError(f"npu_fusion_attention: width {query.size(-1)} is not head_num {head_num} x D")
            head_dim = query.size(-1) // head_num
        else:
            head_dim = query.size(-1)
            if query.size(1 if input_layout == "BNSD" else 2) != head_num:
                raise ValueError(f"npu_fusion_attention: head_num {head_num} for a {input_layout} query "
                                 f"{tuple(query.shape)}")
        q, k, v = (self._to_bnsd(t, input_layout, head_dim) for t in (query, key, value))
        out, row_max, row_sum = self._attend(q, k, v, scale, self._mask(atten_mask, sparse_mode, q.size(2),
                                                                         k.size(2), query.device))
        out = self._from_bnsd(out.to(query.dtype), input_layout)
        return out, row_max, row_sum, query.new_empty(0), 0, 0, 0

    # -- layouts
    @staticmethod
    def _to_bnsd(t, layout, head_dim):
        """`t` in `layout` -> `[B, heads, S, D]`; under BSH / SBH the heads are the width / `head_dim` (the query's
        width / head_num: key / value may have fewer heads)."""
        if layout == "BNSD":
            return t
        if layout == "BSND":
            return t.transpose(1, 2)
        bsh = t if layout == "BSH" else t.transpose(0, 1)
        if bsh.size(-1) % head_dim:
            raise ValueError(f"npu_fusion_attention: width {bsh.size(-1)} is not a multiple of the head dim {head_dim}")
        return bsh.reshape(bsh.size(0), bsh.size(1), -1, head_dim).transpose(1, 2)

    def _from_bnsd(self, out, layout):
        if layout == "BNSD":
            return out
        if layout == "BSND":
            return out.transpose(1, 2)
        b, n, s, d = out.shape
        bsh = out.transpose(1, 2).reshape(b, s, n * d)
        return bsh if layout == "BSH" else bsh.transpose(0, 1)

    # -- the computation (fp32, a materialised softmax: the reference, not a kernel)
    @staticmethod
    def _mask(atten_mask, sparse_mode, sq, sk, device):
        if sparse_mode == 0:
            if atten_mask is None:
                return None
            if atten_mask.shape[-2:] != (sq, sk):
                raise ValueError(f"npu_fusion_attention: atten_mask {tuple(atten_mask.shape)} for {sq} queries x "
                                 f"{sk} keys")
            return atten_mask
        shift = 0 if sparse_mode == 2 else sk - sq
        return torch.arange(sk, device=device)[None, :] > torch.arange(sq, device=device)[:, None] + shift

    @staticmethod
    def _attend(q, k, v, scale, masked):
        """q `[B, N, Sq, D]`, k / v `[B, G, Sk, D]`: (out fp32, softmax_max, softmax_sum)."""
        if q.size(1) % k.size(1):
            raise ValueError(f"npu_fusion_attention: {k.size(1)} key heads do not divide {q.size(1)} query heads")
        if v.size(-1) != k.size(-1):
            raise ValueError(f"npu_fusion_attention: value head dim {v.size(-1)} != key head dim {k.size(-1)}")
        per = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(per, dim=1), v.repeat_interleave(per, dim=1)
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale
        if masked is not None:
            scores = scores.masked_fill(masked, float("-inf"))
        row_max = scores.amax(-1, keepdim=True)
        exp = (scores - row_max).exp()
        row_sum = exp.sum(-1, keepdim=True)
        out = (exp / row_sum) @ v.float()
        return out, row_max.expand(*row_max.shape[:-1], 8).detach(), row_sum.expand(*row_sum.shape[:-1], 8).detach()

    def _tnd(self, query, key, value, head_num, atten_mask, scale, sparse_mode, actual_seq_qlen, actual_seq_kvlen):
        if actual_seq_qlen is None or actual_seq_kvlen is None:
            raise ValueError("npu_fusion_attention: input_layout 'TND' needs actual_seq_qlen and actual_seq_kvlen")
        q_ends, k_ends = _cumulative(actual_seq_qlen, "actual_seq_qlen"), _cumulative(actual_seq_kvlen,
                                                                                        "actual_seq_kvlen")
        if len(q_ends) != len(k_ends):
            raise ValueError(f"npu_fusion_attention: {len(q_ends)} query sequences, {len(k_ends)} key sequences")
        if q_ends[-1] != query.size(0) or k_ends[-1] != key.size(0):
            raise ValueError(f"npu_fusion_attention: the lengths end at {q_ends[-1]} / {k_ends[-1]} tokens, the "
                             f"tensors hold {query.size(0)} / {key.size(0)}")
        if head_num != query.size(1):
            raise ValueError(f"npu_fusion_attention: head_num {head_num} for a query of {query.size(1)} heads")
        if sparse_mode == 0 and atten_mask is not None:
            raise NotImplementedError("npu_fusion_attention stand-in: an explicit mask under TND is not modelled")
        outs, maxes, sums = [], [], []
        for (q0, q1), (k0, k1) in zip(zip([0] + q_ends, q_ends), zip([0] + k_ends, k_ends)):
            q, k, v = (t.transpose(0, 1)[None] for t in (query[q0:q1], key[k0:k1], value[k0:k1]))
            masked = None if sparse_mode == 0 else self._mask(atten_mask, sparse_mode, q1 - q0, k1 - k0, query.device)
            out, row_max, row_sum = self._attend(q, k, v, scale, masked)
            outs.append(out[0].transpose(0, 1))
            maxes.append(row_max[0].transpose(0, 1))
            sums.append(row_sum[0].transpose(0, 1))
        out = torch.cat(outs).to(query.dtype)
        return out, torch.cat(maxes), torch.cat(sums), query.new_empty(0), 0, 0, 0


# ============================================================================================ torch.npu

# streams and events: the CPU's no-op ones (work here is synchronous)
_Stream, _Event = NullStream, NullEvent


class _RecordingModule(types.ModuleType):
    """A module whose unknown attributes fail by name: a torch_npu API the stand-in lacks shows up as such."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"the torch_npu stand-in ({self.__name__}) has no {name!r}: add it to "
                             "tests/helpers/npu_stand_in.py from torch_npu's documentation")


def _npu_namespace(stand_in: "NpuStandIn", device_count: int) -> types.ModuleType:
    npu = _RecordingModule("torch_npu.npu")
    npu.__all__ = []  # what transfer_to_npu copies onto torch.cuda
    state = {"device": 0}
    rec = stand_in.record

    def fn(name, body):
        def call(*args, **kwargs):
            rec(name, args=args, kwargs=kwargs)
            return body(*args, **kwargs)
        call.__name__ = call.__qualname__ = name
        setattr(npu, name, call)
        npu.__all__.append(name)
        return call

    def set_device(device):
        index = device.index if isinstance(device, torch.device) else (
            int(str(device).split(":")[-1]) if isinstance(device, str) and ":" in device else int(device))
        if not 0 <= index < device_count:
            raise RuntimeError(f"torch.npu.set_device({device!r}): {device_count} NPUs")
        state["device"] = index

    npu._is_in_bad_fork = lambda: False  # torch.manual_seed asks the PrivateUse1 module for it, then seeds it
    fn("is_available", lambda: True)
    fn("is_initialized", lambda: True)
    fn("device_count", lambda: device_count)
    fn("current_device", lambda: state["device"])
    fn("set_device", set_device)
    fn("synchronize", lambda device=None: None)
    fn("empty_cache", lambda: None)
    for stat in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        fn(stat, lambda device=None: 0)
    fn("reset_peak_memory_stats", lambda device=None: None)
    fn("reset_max_memory_allocated", lambda device=None: None)
    fn("memory_stats", lambda device=None: {})
    fn("mem_get_info", lambda device=None: (64 << 30, 64 << 30))
    fn("get_device_name", lambda device=None: "Ascend (CPU stand-in)")
    fn("get_device_properties", lambda device=None: types.SimpleNamespace(name="Ascend (CPU stand-in)",
                                                                          total_memory=64 << 30))
    fn("is_bf16_supported", lambda: True)
    # The NPU generator is the CPU default generator (module doc).
    fn("manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)) and None)
    fn("manual_seed_all", lambda seed: torch.default_generator.manual_seed(int(seed)) and None)
    fn("seed", lambda: torch.default_generator.seed() and None)
    fn("initial_seed", lambda: torch.default_generator.initial_seed())
    fn("get_rng_state", lambda device="npu": torch.get_rng_state())
    fn("set_rng_state", lambda new_state, device="npu": torch.set_rng_state(new_state))
    npu.default_generators = tuple(torch.default_generator for _ in range(device_count))
    random = _RecordingModule("torch_npu.npu.random")
    random.__all__ = ["manual_seed", "manual_seed_all", "seed", "initial_seed", "get_rng_state", "set_rng_state"]
    for name in random.__all__:
        setattr(random, name, getattr(npu, name))
    npu.random = random
    npu.Stream = type("Stream", (_Stream,), {})
    npu.Event = type("Event", (_Event,), {})
    npu.__all__ += ["default_generators", "Stream", "Event"]
    fn("current_stream", lambda device=None: _Stream())
    fn("default_stream", lambda device=None: _Stream())
    fn("stream", lambda stream=None: contextlib.nullcontext())
    return npu


# ============================================================================================ profiler

class _ProfilerActivity:
    CPU = "CPU"
    NPU = "NPU"


_PROFILE_KEYWORDS = frozenset({"activities", "schedule", "on_trace_ready", "record_shapes", "profile_memory",
                               "with_stack", "with_flops", "with_modules", "experimental_config"})


def _profiler_namespace(stand_in: "NpuStandIn") -> types.ModuleType:
    prof = _RecordingModule("torch_npu.profiler")
    prof.ProfilerActivity = _ProfilerActivity
    prof.ProfilerAction = torch.profiler.ProfilerAction

    def profile(**kwargs):
        unknown = set(kwargs) - _PROFILE_KEYWORDS
        if unknown:
            raise TypeError(f"torch_npu.profiler.profile: unexpected keywords {sorted(unknown)}")
        activities = list(kwargs.pop("activities", [_ProfilerActivity.CPU, _ProfilerActivity.NPU]))
        bad = [a for a in activities if a not in (_ProfilerActivity.CPU, _ProfilerActivity.NPU)]
        if bad:
            raise TypeError(f"torch_npu.profiler.profile: activities {bad} are not torch_npu.profiler.ProfilerActivity")
        stand_in.record("profiler.profile", activities=activities, keywords=sorted(kwargs))
        kwargs.pop("experimental_config", None)
        return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], **kwargs)

    def schedule(*, wait, active, warmup=0, repeat=0, skip_first=0):
        stand_in.record("profiler.schedule", wait=wait, warmup=warmup, active=active, repeat=repeat)
        return torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=repeat, skip_first=skip_first)

    def tensorboard_trace_handler(dir_name, worker_name=None, analyse_flag=True):
        stand_in.record("profiler.tensorboard_trace_handler", dir_name=dir_name, worker_name=worker_name)
        return torch.profiler.tensorboard_trace_handler(dir_name, worker_name=worker_name)

    prof.profile, prof.schedule, prof.tensorboard_trace_handler = profile, schedule, tensorboard_trace_handler
    return prof


# ============================================================================================ transfer_to_npu

def _hccl_for_nccl(init_process_group):
    def wrapped(*args, **kwargs):
        args = tuple(a.replace("nccl", "hccl") if isinstance(a, str) else a for a in args)
        if isinstance(kwargs.get("backend"), str):
            kwargs["backend"] = kwargs["backend"].replace("nccl", "hccl")
        return init_process_group(*args, **kwargs)
    wrapped.__wrapped__ = init_process_group
    return wrapped


def _tensor_npu(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    index = torch.npu.current_device() if device is None else device
    target = index if isinstance(index, torch.device) else torch.device("npu", int(index))
    return self.to(target, non_blocking=non_blocking, memory_format=memory_format)


def _module_npu(self, device=None):
    index = torch.npu.current_device() if device is None else device
    return self.to(index if isinstance(index, torch.device) else torch.device("npu", int(index)))


# ============================================================================================ the stand-in

class NpuStandIn:
    """The installed stand-in: `calls` [(name, info)] in order, `count(name)`, `last(name)`, `transferred`."""

    def __init__(self, device_count: int = DEVICE_COUNT):
        self.device_count = device_count
        self.calls: List[tuple] = []
        self.transferred = False
        self._undo: List[tuple] = []  # (owner, name, had, old)
        self.fusion_attention = FusionAttention(self)
        self.torch_npu = self._build()

    # -- records
    def record(self, name: str, **info) -> None:
        self.calls.append((name, info))

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.calls if n == name)

    def of(self, name: str) -> List[Dict[str, Any]]:
        return [info for n, info in self.calls if n == name]

    def last(self, name: str) -> Optional[Dict[str, Any]]:
        found = self.of(name)
        return found[-1] if found else None

    def counts(self) -> Counter:
        return Counter(n for n, _ in self.calls)

    def clear(self) -> None:
        self.calls.clear()
        self.fusion_attention.calls.clear()

    # -- the module tree
    def _build(self) -> types.ModuleType:
        root = _RecordingModule("torch_npu")
        root.__file__ = __file__
        root.__path__ = []  # a package: `import torch_npu.contrib` finds its submodules in sys.modules
        root.__version__ = "stand-in"
        root.npu = _npu_namespace(self, self.device_count)
        root.profiler = _profiler_namespace(self)
        root.npu_fusion_attention = self.fusion_attention
        for name in ("npu_rms_norm", "npu_swiglu", "npu_rotary_position_embedding"):
            root.__dict__[name] = self._recorded_op(name, getattr(npu_fused_reference, name))
        contrib = _RecordingModule("torch_npu.contrib")
        contrib.__path__ = []
        stand_in = self

        def contrib_getattr(name):  # `from torch_npu.contrib import transfer_to_npu` runs the redirection once
            if name == "transfer_to_npu":
                return stand_in._transfer_to_npu()
            return _RecordingModule.__getattr__(contrib, name)
        contrib.__getattr__ = contrib_getattr
        root.contrib = contrib
        return root

    def _recorded_op(self, name, reference):
        def op(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            self.record(name, shapes=[tuple(t.shape) for t in tensors],
                        dtype=str(tensors[0].dtype).replace("torch.", "") if tensors else None,
                        options={k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)},
                        positional=[a for a in args if not isinstance(a, torch.Tensor)])
            return reference(*args, **kwargs)
        op.__name__ = op.__qualname__ = name
        return op

    def _set(self, owner, name, value) -> None:
        had = name in vars(owner) if isinstance(owner, type) else hasattr(owner, name)
        old = vars(owner)[name] if isinstance(owner, type) and had else getattr(owner, name, None)
        self._undo.append((owner, name, had, old))
        setattr(owner, name, value)

    def _transfer_to_npu(self) -> types.ModuleType:
        module = sys.modules.get("torch_npu.contrib.transfer_to_npu")
        if module is not None:
            return module
        self.record("transfer_to_npu")
        self.transferred = True
        npu = self.torch_npu.npu
        # torch_npu's _apply_patches: a patch module with `__all__` has those names copied onto the module it
        # replaces, so `torch.cuda.X` and `torch.cuda.random.X` answer with torch.npu's X; the rest stays CUDA's.
        for target, source in ((torch.cuda, npu), (torch.cuda.random, npu.random)):
            for name in source.__all__:
                self._set(target, name, getattr(source, name))
        self._set(torch.Tensor, "cuda", _tensor_npu)
        self._set(torch.Tensor, "npu", _tensor_npu)
        self._set(torch.nn.Module, "cuda", _module_npu)
        self._set(torch.distributed, "init_process_group", _hccl_for_nccl(torch.distributed.init_process_group))
        import torch.utils._triton as triton_utils

        self._set(triton_utils, "has_triton", lambda: False)
        module = _RecordingModule("torch_npu.contrib.transfer_to_npu")
        sys.modules[module.__name__] = module
        self.torch_npu.contrib.__dict__["transfer_to_npu"] = module
        return module

    # -- install / remove
    def install(self) -> None:
        global _ACTIVE
        if _ACTIVE is not None or "torch_npu" in sys.modules:
            raise RuntimeError("torch_npu is already imported in this process (a real one, or the stand-in "
                               "installed twice)")
        ensure_npu_device_name()
        for name, module in (("torch_npu", self.torch_npu), ("torch_npu.npu", self.torch_npu.npu),
                             ("torch_npu.profiler", self.torch_npu.profiler),
                             ("torch_npu.contrib", self.torch_npu.contrib)):
            sys.modules[name] = module
        self._set(torch, "npu", self.torch_npu.npu)
        _ACTIVE = self

    def remove(self) -> None:
        global _ACTIVE
        while self._undo:
            owner, name, had, old = self._undo.pop()
            if had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        for name in [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]:
            del sys.modules[name]
        _ACTIVE = None


@contextlib.contextmanager
def installed(device_count: int = DEVICE_COUNT):
    """The stand-in as `torch_npu` for the block; yields the `NpuStandIn` (its records)."""
    stand_in = NpuStandIn(device_count)
    stand_in.install()
    try:
        yield stand_in
    finally:
        stand_in.remove()
