"""A CPU guard that makes host/device mix-ups visible: `with virtual_device(): ...`.

On a CPU-only machine every tensor lives on the CPU, so a tensor that code forgot to put on the accelerator
(the model never moved, a `torch.zeros(n)` added to scores computed on the device, a broadcast buffer made with
`torch.empty(shape)`) works here and fails on a GPU with "Expected all tensors to be on the same device". Inside
`virtual_device()` every tensor carries a *virtual location*, "host" or "device", and an operation that mixes
the two raises `DeviceMixError` (or, with `on_mix="record"`, is collected in `.mixes`), as CUDA would fail.

    with virtual_device() as vd:          # vd.location(t) -> "host" | "device"
        model.to(mindspeed_llm.device.current_device())
        ...

The model
---------
* "The accelerator" is a marker device, `MARKER = torch.device("meta")`. Inside the guard
  `mindspeed_llm.device.current_device()` and `torch.cuda.current_device()` return it (not the latter under
  the `torch_npu` stand-in, `npu_stand_in.py`: its `transfer_to_npu` answers with an int, an accelerator too).
  Wherever it reaches torch (a factory's `device=`, `Tensor.to(...)`, `.cuda()`, `Module.to(...)`), the guard
  computes on the real CPU and marks the result "device". `virtual_device(marker=...)` picks another marker
  (the NPU lane: "npu:N", so that code branching on `x.device.type` sees "npu"). "cuda", "cuda:N", an int N and
  any other non-CPU device count as the marker too.
* Locations belong to *storage*, like real memory: views, `.data`, `.detach()`, `nn.Parameter(t)` and a
  `param.data = t` swap (what `Module.to` does) share or take a storage, and so its location. New storage gets:
    - a factory (`torch.zeros/empty/tensor/arange/...`): "device" with the marker, "host" without a device or
      with "cpu" (torch's default device is the CPU, as on a GPU machine);
    - `x.to(marker)`, `x.cuda()`: "device"; `x.cpu()`, `x.to("cpu")`: "host". A move between locations always
      copies (on a GPU it does); a "move" to where a tensor already is returns it, as torch does;
    - any other op: "device" if any tensor input is "device", else "host"; an op without tensor inputs inside
      a Python-level call (a buffer a composite op makes) takes that call's location.
  Autograd follows: the backward runs with both modes active, so gradients, `.grad`, megatron's `main_grad`
  and custom `autograd.Function.backward` code get and are checked like forward code.
  Tensors created before the guard was entered, and tensors made outside torch's ops (`torch.from_numpy`,
  `torch.load`, safetensors), are "host".
* `x.device` of a "device" tensor reads as the marker in code outside the `torch` package (project, megatron,
  tests), so `torch.zeros(n, device=x.device)` lands where `x` is. Inside torch's own Python code it stays the
  real `cpu`, because torch branches on it (`torch.optim`'s fused Adam rejects a `device.type` not in its list,
  foreach/capturable checks); the one torch-internal move "to where the parameter is" that this affects,
  `Optimizer.load_state_dict`'s cast of the loaded state, is adapted. For code that branches on
  `x.device.type`: a device tensor reads as "meta", so `== "cpu"` tests are False as on a GPU (megatron's RoPE
  moves `inv_freq` only when its type is "cpu"), and `== "cuda"` tests are False too (a GPU would take them;
  the CPU cannot run those paths anyway). `x.is_cuda` and `x.get_device()` are unchanged.

How (measured on torch 2.13, CPU build)
---------------------------------------
* A `TorchFunctionMode` sees calls as written: `torch.zeros(3)` has no `device` there, `device=...` is the
  caller's; it also sees the property getters `Tensor.device`, `.data`, `.grad`, `.shape` (and the `.data`
  setter) and the `torch.distributed` collectives. It rewrites the marker to the CPU, handles `.to/.cpu`, the
  `.device` getter and `numpy()`, and names the user-level call in messages.
* A `TorchDispatchMode` sees every aten op, forward and backward, including the `c10d` collective ops and
  what the autograd engine runs; it does the checks and gives fresh storage its location. Factories reach it
  with `device=cpu` filled in (so it cannot tell "no device" from "cpu"); the marker reaches it as `meta`.
* `nn.Parameter(t)` is seen by neither mode; it shares `t`'s storage, hence keyed by storage.
* torch pops a function mode while it handles a call, so the backward of `loss.backward()` would run without
  it; the guard runs `Tensor.backward` / `torch.autograd.backward` itself (torch 2.13's body of
  `torch.autograd.backward`) with the mode pushed back.

What raises
-----------
* Any aten op whose tensor inputs include a "device" tensor and a "host" tensor with at least one dimension.
  Exempt, because CUDA accepts them:
    - 0-dim host tensors (CUDA takes CPU scalars in elementwise kernels; it refuses them in a few others,
      e.g. `index_select`, so the guard is more lenient than CUDA there). A 0-dim *device* tensor with a host
      vector raises, as on CUDA;
    - the copy family (`copy_`, `_to_copy`): cross-device by definition (`host[...] = device_tensor`, `.cpu()`);
    - host *index* tensors of a "device" tensor in advanced indexing (`dev[host_idx]`, `dev[host_mask] = v`):
      CUDA moves CPU indices itself. A "device" index into a "host" tensor raises (the embedding bug); the
      values of an index_put must be where the tensor is.
* A `torch.distributed` collective or p2p op (any `c10d` op) given a "host" tensor: NCCL takes device tensors
  only. Exempt: `barrier` (torch makes its own buffer) and the buffers the `*_object` collectives
  (`all_gather_object`, `broadcast_object_list`, ...) build themselves: torch puts them on the backend's device.
* `x.numpy()` / `np.asarray(x)` of a "device" tensor (a GPU refuses it; `numpy(force=True)` copies).

`pin_memory=True` in a factory call is dropped (a CPU-only torch cannot pin without an accelerator's runtime) and
counted in `.pinned`: the tensor is host memory, as a pinned one is.

Adapters while the guard is active
----------------------------------
The project's CPU patches (mindspeed_llm/patches/cpu.py) turn megatron's `device='cuda'` into the CPU before
torch sees it; the guard makes `_cpu_device` say the marker and replaces the causal-mask helper, so that what is
on the GPU in a GPU run is "device" here. `apply_patches()` may run inside the guard (`distributed.initialize()`
calls it): the guard's overrides step aside for it and go back on top, and the patches stay after the guard.

Known limitations
-----------------
* Megatron's gloo groups (`parallel_state.get_*_group_gloo()`) take host tensors on a GPU machine too; the
  guard does not know a group's backend and would flag them (the project's training path does not use them).
* Inside `torch.autograd.grad(...)` (not `backward`) only the dispatch mode is active: explicit devices in
  custom backward code there are not seen (buffers take the location of the call).
* Other torch-internal code that moves a tensor to `other.device` (besides the optimizer-state cast) would
  move it to the host. `torch.tensor(data, device=MARKER)` outside any Python-level call makes a real meta
  tensor, which fails loudly.
* Real use of the meta device inside the guard (lazy init under `torch.device("meta")`) reads as the accelerator.
* One host and one device: cuda:0 vs cuda:1 is not modelled. Modes are per thread: other threads are unguarded.
  Blocks do not nest.
* Overhead: about +45% wall time on a tiny-model grpo iteration (Python bookkeeping per aten op).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import os
import sys
import weakref
from typing import Any, Dict, List, Optional

import torch
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MARKER", "HOST", "DEVICE", "DeviceMixError", "VirtualDevice", "virtual_device"]

MARKER = torch.device("meta")
HOST, DEVICE = "host", "device"
CPU = torch.device("cpu")

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)
_aten = torch.ops.aten

# Ops that CUDA runs with inputs on different devices (copies between them).
_COPY_OPS = frozenset({
    _aten.copy_.default, _aten.copy.default, _aten._to_copy.default, _aten._copy_from.default,
    _aten._copy_from_and_resize.default,
})
# Advanced indexing: CUDA accepts CPU index tensors for a CUDA self (args: self, indices, [values, ...]).
_INDEX_OPS = frozenset({
    _aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default, _aten._index_put_impl_.default,
    _aten._unsafe_index.Tensor, _aten._unsafe_index_put.default,
})
_OP_TYPES = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})


class DeviceMixError(RuntimeError):
    """An operation mixed "host" and "device" tensors (or gave a collective a host tensor)."""


def _is_accelerator(device) -> bool:
    """Whether a device argument means the accelerator: the marker, 'cuda[:N]', an int N, any non-CPU type."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        device = torch.device(device)
    return isinstance(device, torch.device) and device.type != "cpu"


def _is_device_arg(value) -> bool:
    return isinstance(value, (torch.device, str)) or (isinstance(value, int) and not isinstance(value, bool))


def _tensors(values, out: List[torch.Tensor], depth: int = 2) -> List[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif depth and isinstance(v, (list, tuple)):
            _tensors(v, out, depth - 1)
    return out


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except Exception:  # tensors without storage (sparse, nested): untracked, read as host
        return None


def _user_frames(limit: int = 14) -> List[str]:
    """The innermost `limit` frames outside torch and this file, outermost first."""
    frames, f = [], sys._getframe(1)
    while f is not None and len(frames) < limit:
        name = f.f_code.co_filename
        if not name.startswith(_TORCH_DIR) and os.path.abspath(name) != _THIS_FILE and not name.startswith("<"):
            line = linecache.getline(name, f.f_lineno).strip()
            frames.append(f'  File "{name}", line {f.f_lineno}, in {f.f_code.co_name}\n    {line}')
        f = f.f_back
    return frames[::-1]


def _in_object_collective() -> bool:
    """True inside torch.distributed's *_object(_list) functions (they build and place their own buffers)."""
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        if code.co_filename.endswith("distributed_c10d.py") and (
                code.co_name.endswith("_object") or code.co_name.endswith("_object_list")):
            return True
        f = f.f_back
    return False


def _op_name(func) -> str:
    name = resolve_name(func)
    if name is None and getattr(func, "__module__", None) and getattr(func, "__qualname__", None):
        name = f"{func.__module__}.{func.__qualname__}"  # e.g. torch.autograd.backward, torch.distributed's
    return name or repr(func)


class VirtualDevice:
    """The state of one `virtual_device()` block: locations by storage, the call context, recorded mixes."""

    def __init__(self, on_mix: str = "raise", marker: torch.device = MARKER):
        if on_mix not in ("raise", "record"):
            raise ValueError("on_mix must be 'raise' or 'record'")
        if marker.type == "cpu":
            raise ValueError("the accelerator's marker cannot be a CPU device")
        self.on_mix = on_mix
        self.marker = marker
        self.mixes: List[Dict[str, Any]] = []  # on_mix="record": one entry per distinct (op, user frame)
        self.ops_seen = 0  # aten ops dispatched under the guard
        self.pinned = 0  # factory calls with pin_memory=True (made as plain host memory: nothing to pin for)
        self._tags: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
        # Python-level calls in progress: (func, args, kwargs, explicit location or None).
        self._calls: List[tuple] = []

    # ------------------------------------------------------------------ locations
    def location(self, t: torch.Tensor) -> str:
        """'host' or 'device'."""
        s = _storage(t)
        return self._tags.get(s, HOST) if s is not None else HOST

    def is_device(self, t: torch.Tensor) -> bool:
        return self.location(t) == DEVICE

    def _set(self, t: torch.Tensor, tag: str) -> None:
        s = _storage(t)
        if s is not None:
            self._tags[s] = tag

    def _call_location(self) -> str:
        """Where the innermost Python-level call puts tensors it makes from nothing (its internal buffers)."""
        if not self._calls:
            return HOST
        func, args, kwargs, explicit = self._calls[-1]
        if explicit is not None:
            return explicit
        inputs = _tensors(list(args) + list(kwargs.values()), [])
        return DEVICE if any(self.location(t) == DEVICE for t in inputs) else HOST

    def _context(self) -> str:
        return " inside ".join(_op_name(c[0]) for c in reversed(self._calls[-3:])) or "(no Python-level call)"

    # ------------------------------------------------------------------ checks
    def _describe(self, tensors) -> str:
        return "\n".join(f"  [{i}] {self.location(t):6s} shape={tuple(t.shape)} dtype={t.dtype}"
                         for i, t in enumerate(tensors))

    def _report(self, kind: str, func, tensors) -> None:
        frames = _user_frames()
        message = (f"{kind} in {func} (called as {self._context()})\ninputs:\n{self._describe(tensors)}\n"
                   f"user stack (innermost last):\n" + "\n".join(frames))
        if self.on_mix == "raise":
            raise DeviceMixError(message)
        key = (str(func), frames[-1] if frames else "")
        if all((m["op"], m["where"]) != key for m in self.mixes):
            self.mixes.append({"op": str(func), "call": self._context(), "where": key[1], "kind": kind,
                               "inputs": [(self.location(t), tuple(t.shape)) for t in tensors],
                               "message": message})

    def _check_op(self, func, args, tensors) -> None:
        if func in _COPY_OPS or len(tensors) < 2:
            return
        checked = tensors
        if func in _INDEX_OPS and self.location(args[0]) == DEVICE:
            host_indices = {id(t) for t in _tensors(args[1], []) if self.location(t) == HOST}
            checked = [t for t in tensors if id(t) not in host_indices]
        on_device = host = False
        for t in checked:
            if self.location(t) == DEVICE:
                on_device = True
            elif t.dim() > 0:
                host = True
        if on_device and host:
            self._report("host/device mix", func, checked)

    def _check_collective(self, func, tensors) -> None:
        if func.__name__.startswith(("barrier", "monitored_barrier")):
            return
        if any(self.location(t) == HOST for t in tensors) and not _in_object_collective():
            self._report("host tensor in a collective", func, tensors)


class _FunctionMode(TorchFunctionMode):
    """Python-level calls: device arguments as written, moves between locations, `.device` reads."""

    def __init__(self, vd: VirtualDevice):
        super().__init__()
        self.vd = vd
        T = torch.Tensor
        self.special = {
            T.to: self._to, T.cpu: self._cpu, T.device.__get__: self._device_get,
            T.numpy: self._numpy, T.__array__: self._numpy, torch._C._nn._parse_to: self._passthrough,
            T.backward: self._backward, torch.autograd.backward: self._backward,
        }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, _OP_TYPES):  # an aten op called from Python (e.g. by the dispatch mode while this
            return func(*args, **kwargs)  # mode is active in a backward): the dispatch mode's business
        special = self.special.get(func)
        if special is not None:
            return special(func, args, kwargs)
        vd = self.vd
        if kwargs.get("pin_memory"):  # page-locked host memory needs an accelerator's runtime: host memory here
            kwargs = dict(kwargs, pin_memory=False)
            vd.pinned += 1
        explicit = None
        device = kwargs.get("device")
        if device is not None and _is_device_arg(device):
            explicit = DEVICE if _is_accelerator(device) else HOST
            if explicit == DEVICE:
                kwargs = dict(kwargs, device=CPU)
        vd._calls.append((func, args, kwargs, explicit))
        try:
            out = func(*args, **kwargs)
        finally:
            vd._calls.pop()
        if explicit is not None:
            out = self._place(out, args, explicit)
        return out

    def _place(self, out, args, tag):
        """Outputs of a call with an explicit device: fresh storage gets `tag`; an input returned as is (e.g.
        `torch.as_tensor(t, device=...)`) is copied when it is not already there."""
        vd = self.vd
        inputs = {id(s) for s in map(_storage, _tensors(args, [])) if s is not None}
        if isinstance(out, torch.Tensor) and id(_storage(out)) in inputs:
            if vd.location(out) != tag:
                out = out.clone()
                vd._set(out, tag)
            return out
        for t in _tensors([out], []):
            if id(_storage(t)) not in inputs:
                vd._set(t, tag)
        return out

    @staticmethod
    def _passthrough(func, args, kwargs):
        return func(*args, **kwargs)

    def _to(self, func, args, kwargs):
        vd = self.vd
        t, rest, kwargs = args[0], list(args[1:]), dict(kwargs)
        target, copy_at = None, None
        if rest and isinstance(rest[0], torch.Tensor):  # to(other, non_blocking, copy)
            target, copy_at = vd.location(rest[0]), 2
        else:
            if "device" in kwargs and kwargs["device"] is not None:
                target = DEVICE if _is_accelerator(kwargs["device"]) else HOST
                if target == DEVICE:
                    kwargs["device"] = CPU
            elif rest and _is_device_arg(rest[0]):  # to(device, dtype, non_blocking, copy)
                target, copy_at = (DEVICE if _is_accelerator(rest[0]) else HOST), 3
                if target == DEVICE:
                    rest[0] = CPU
            else:  # to(dtype, non_blocking, copy): no move
                copy_at = 2
        if target is not None and target != vd.location(t):  # a move between locations is a copy
            if copy_at is not None and len(rest) > copy_at:
                rest[copy_at] = True
            else:
                kwargs["copy"] = True
        vd._calls.append((func, args, kwargs, target))
        try:
            out = func(t, *rest, **kwargs)
        finally:
            vd._calls.pop()
        if target is not None and _storage(out) is not _storage(t):
            vd._set(out, target)
        return out

    def _cpu(self, func, args, kwargs):
        t = args[0]
        if self.vd.location(t) != DEVICE:
            return func(*args, **kwargs)
        out = t.to(CPU, copy=True, memory_format=kwargs.get("memory_format", torch.preserve_format))
        self.vd._set(out, HOST)
        return out

    def _device_get(self, func, args, kwargs):
        device = func(*args, **kwargs)
        if device.type == "cpu" and self.vd.location(args[0]) == DEVICE:
            # frame 1 is __torch_function__, frame 2 the code that read `.device`
            if not sys._getframe(2).f_code.co_filename.startswith(_TORCH_DIR):
                return self.vd.marker
        return device

    def _backward(self, func, args, kwargs):
        """`loss.backward()` / `torch.autograd.backward(...)` with this mode active during the backward, so that
        custom `autograd.Function.backward`s and hooks are seen like forward code (torch pops a mode while
        it handles a call; calling the function again with the mode pushed back would only come back here).
        The body is torch 2.13's `torch.autograd.backward` after its torch-function check."""
        from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
        from torch.autograd.graph import _engine_run_backward

        b = inspect.signature(func).bind(*args, **kwargs)
        b.apply_defaults()
        a = b.arguments
        if func is torch.Tensor.backward:
            tensors, grad_tensors = (a["self"],), a["gradient"]
        else:
            tensors, grad_tensors = a["tensors"], a["grad_tensors"]
            tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        inputs = a["inputs"]
        if inputs is None:
            inputs = ()
        elif isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        elif isinstance(inputs, dict):
            inputs = tuple(inputs.values())
        else:
            inputs = tuple(inputs)
        retain_graph, create_graph = a["retain_graph"], a["create_graph"]
        self.vd._calls.append((func, tensors, {}, None))
        try:
            with self:
                grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)),
                                    is_grads_batched=False)
                _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph,
                                     create_graph, inputs, allow_unreachable=True, accumulate_grad=True)
        finally:
            self.vd._calls.pop()

    def _numpy(self, func, args, kwargs):
        if self.vd.location(args[0]) == DEVICE and not kwargs.get("force", False):
            self.vd._report("numpy() of a device tensor", _op_name(func), [args[0]])
        return func(*args, **kwargs)


class _DispatchMode(TorchDispatchMode):
    """aten ops, forward and backward: the marker in `device=`, the mix checks, the locations of outputs."""

    def __init__(self, vd: VirtualDevice):
        super().__init__()
        self.vd = vd

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        vd = self.vd
        vd.ops_seen += 1
        kwargs = kwargs or {}
        device = kwargs.get("device")
        explicit = None
        if device is not None:
            explicit = DEVICE if _is_accelerator(device) else HOST
            if explicit == DEVICE:
                kwargs = dict(kwargs, device=CPU)
        if func.namespace in _COLLECTIVE_NAMESPACES:
            vd._check_collective(func, _tensors(list(args) + list(kwargs.values()), [], depth=3))
            return func(*args, **kwargs)
        inputs = _tensors(list(args) + list(kwargs.values()), [])
        vd._check_op(func, args, inputs)
        out = func(*args, **kwargs)
        # Where fresh storage lands: the marker in `device=`; else the inputs' location (device if any);
        # else (a factory) the enclosing Python-level call's. An explicit `device=cpu` here says nothing:
        # torch fills it in for factories, and C++ composites pass `input.options()` (F.rms_norm's dtype
        # cast is `_to_copy(x, dtype=..., device=cpu)`); the Python-level mode handles a user's 'cpu'.
        if explicit == DEVICE:
            tag = DEVICE
        elif inputs:
            tag = DEVICE if any(vd.location(t) == DEVICE for t in inputs) else HOST
        else:
            tag = vd._call_location()
        for t in _tensors([out], []):
            s = _storage(t)
            if s is not None and s not in vd._tags:
                vd._tags[s] = tag
        return out


@contextlib.contextmanager
def _patched(owner, name: str, value):
    had = name in vars(owner) if isinstance(owner, type) else hasattr(owner, name)
    old = vars(owner)[name] if isinstance(owner, type) and had else getattr(owner, name, None)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)


def _guarded_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self.to(MARKER, non_blocking=non_blocking, memory_format=memory_format)


class _Overrides:
    """What the guard replaces while it is active: `current_device()` (ours and torch.cuda's) -> the marker,
    `Tensor.cuda` -> a move to the marker, and adapters of the project's CPU patches (they turn megatron's
    `device='cuda'` into the CPU before torch sees it; here they say the marker, so that what is on the GPU in a
    GPU run is "device"). `mindspeed_llm.patches.apply_patches()` may run inside the guard (`distributed.
    initialize()` calls it): the guard then takes its overrides off, lets the patches apply to (and record)
    the real originals, and puts them back on top; on exit the patched state is what remains."""

    def __init__(self, vd: VirtualDevice):
        self.vd = vd
        self._stack: Optional[contextlib.ExitStack] = None

    def install(self) -> None:
        stack = contextlib.ExitStack()
        try:
            project_device = sys.modules.get("mindspeed_llm.device")
            if project_device is not None:
                stack.enter_context(_patched(project_device, "current_device", _marker_device(self.vd.marker)))
            if "torch_npu" not in sys.modules:
                # its own function object: one object under two names upsets torch.compile (see patches/cpu.py)
                stack.enter_context(_patched(torch.cuda, "current_device", _marker_device(MARKER)))
                stack.enter_context(_patched(torch.Tensor, "cuda", _guarded_cuda))
            # else (torch_npu, the stand-in of tests/helpers/npu_stand_in.py): its transfer_to_npu answers
            # torch.cuda.current_device() with an int and moves `.cuda()` to "npu:N", both read as the accelerator
            # already; patching them here would undo its redirection whenever apply_patches steps the guard aside
            stack.enter_context(_patched(torch.optim.Optimizer, "_process_value_according_to_param_policy",
                                         staticmethod(self._optimizer_state_cast())))
            self._adapt_cpu_patches(stack)
        except BaseException:
            stack.close()
            raise
        self._stack = stack

    def remove(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def _optimizer_state_cast(self):
        """`Optimizer.load_state_dict` puts each loaded state tensor where its parameter is, reading
        `param.device` inside torch (where it is the real CPU): the result goes where the parameter is.
        (`step` is left alone: a 0-dim counter, on the host unless the optimizer is fused / capturable.)"""
        original = torch.optim.Optimizer._process_value_according_to_param_policy
        vd = self.vd

        def cast(param, value, param_id, param_groups, key=None):
            out = original(param, value, param_id, param_groups, key)
            if (isinstance(out, torch.Tensor) and key != "step" and vd.location(param) == DEVICE
                    and vd.location(out) != DEVICE):
                if _storage(out) is _storage(value):
                    out = out.clone()
                vd._set(out, DEVICE)
            return out
        return cast

    @staticmethod
    def _adapt_cpu_patches(stack: contextlib.ExitStack) -> None:
        cpu_patches = sys.modules.get("mindspeed_llm.patches.cpu")
        if cpu_patches is None:
            return
        original = cpu_patches._cpu_device  # the _TorchOnCpu factories map device='cuda' through it

        def _cpu_device(device):
            if device is not None and _is_accelerator(device):
                return MARKER
            return original(device)

        stack.enter_context(_patched(cpu_patches, "_cpu_device", _cpu_device))

        @functools.lru_cache(maxsize=32)  # per installation: a mask made under another guard has no location
        def get_default_causal_mask(sq: int) -> torch.Tensor:  # megatron builds it with device='cuda'
            return torch.triu(torch.ones(sq, sq, dtype=torch.bool, device=MARKER), diagonal=1)

        for site in ("megatron.core.transformer.utils", "megatron.core.fusions.fused_softmax"):
            module = sys.modules.get(site)
            fn = getattr(module, "get_default_causal_mask", None)
            if fn is not None and getattr(fn, "__module__", "") == cpu_patches.__name__:
                stack.enter_context(_patched(module, "get_default_causal_mask", get_default_causal_mask))

    def wrap(self, stack: contextlib.ExitStack) -> None:
        """Route the project's apply_patches / remove_patches around the overrides (see the class doc)."""
        try:
            from mindspeed_llm import patches
        except ImportError:
            return
        for name in ("apply_patches", "remove_patches"):
            stack.enter_context(_patched(patches, name, self._around(getattr(patches, name))))

    def _around(self, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            self.remove()
            try:
                return fn(*args, **kwargs)
            finally:
                self.install()
        return call


def _marker_device(marker: torch.device):
    def current_device() -> torch.device:
        return marker
    return current_device


_ACTIVE = False


def _deactivate() -> None:
    global _ACTIVE
    _ACTIVE = False


@contextlib.contextmanager
def virtual_device(on_mix: str = "raise", marker: torch.device = MARKER):
    """Run a block with virtual host/device locations; yields the `VirtualDevice` (`.location(t)`,
    `.mixes`). `on_mix="record"` collects every distinct mix in `.mixes` instead of raising at the first.
    `marker`: what a device tensor's `.device` and `current_device()` read as (the NPU lane: "npu:N", with the
    `torch_npu` stand-in, so that code branching on `x.device.type` sees "npu" as on an NPU)."""
    global _ACTIVE
    if _ACTIVE:
        raise RuntimeError("virtual_device() blocks do not nest")
    vd = VirtualDevice(on_mix, marker)
    overrides = _Overrides(vd)
    with contextlib.ExitStack() as stack:
        _ACTIVE = True
        stack.callback(_deactivate)
        try:  # import (not apply) so the overrides and adapters find them whenever they get applied
            import mindspeed_llm.device  # noqa: F401
            import mindspeed_llm.patches.cpu  # noqa: F401
        except ImportError:  # the guard also works on plain torch code
            pass
        overrides.wrap(stack)
        overrides.install()
        stack.callback(overrides.remove)
        stack.enter_context(_FunctionMode(vd))
        stack.enter_context(_DispatchMode(vd))
        yield vd
