"""CPU answers to megatron-core 0.16.1's hard-coded CUDA calls (devices: cpu only).

Measured on 2 cores with torch 2.13.0+cpu and gloo (see shared/MEGATRON_ON_CPU.md): with these patches
GPTModel forward/backward (local spec), DDP, the Megatron optimizer with grad clipping, the pipeline
schedules and the legacy static inference path give the same numbers as a single-process reference.

Rules kept here:
- patch megatron's own helpers, or the `torch` name *inside* the megatron modules that build tensors with
  `device='cuda'`, never torch's tensor factories globally;
- every `torch.cuda.*` name gets its own function object: one object under several names makes importing
  anything torch.compile'd fail ("Duplicate torch object ... with different rules").
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch

from mindspeed_llm.patches import register

CPU = torch.device("cpu")


# ---------------------------------------------------------------- torch.cuda device and RNG queries
# megatron calls these directly; on CPU the "CUDA" generator is the CPU generator, the device is the CPU.

@register("torch.cuda.current_device", "megatron passes it as device=; an int would mean cuda:N")
def _current_device(_original):
    def current_device():
        return CPU
    return current_device


@register("torch.cuda.device_count", "megatron divides ranks by it; a CPU process drives one device")
def _device_count(_original):
    def device_count():
        return 1
    return device_count


@register("torch.cuda.set_device", "megatron/torchrun helpers pin a device; nothing to pin on CPU")
def _set_device(_original):
    def set_device(_device=None):
        return None
    return set_device


@register("torch.cuda.synchronize", "timers and schedules synchronize; CPU work is already done")
def _synchronize(_original):
    def synchronize(_device=None):
        return None
    return synchronize


@register("torch.cuda.empty_cache", "the optimizer and inference free the caching allocator; none on CPU")
def _empty_cache(_original):
    def empty_cache():
        return None
    return empty_cache


@register("torch.cuda.get_rng_state", "the tensor-parallel RNG tracker saves the 'cuda' RNG: use the CPU one")
def _get_rng_state(_original):
    def get_rng_state(device="cuda"):
        return torch.get_rng_state()
    return get_rng_state


@register("torch.cuda.set_rng_state", "the tensor-parallel RNG tracker restores the 'cuda' RNG")
def _set_rng_state(_original):
    def set_rng_state(new_state, device="cuda"):
        torch.set_rng_state(new_state)
    return set_rng_state


@register("torch.cuda.manual_seed", "model_parallel_cuda_manual_seed seeds the 'cuda' RNG")
def _manual_seed(_original):
    def manual_seed(seed):
        torch.default_generator.manual_seed(int(seed))
    return manual_seed


@register("torch.cuda.manual_seed_all", "seeding helpers seed every 'cuda' RNG")
def _manual_seed_all(_original):
    def manual_seed_all(seed):
        torch.default_generator.manual_seed(int(seed))
    return manual_seed_all


@register(
    "megatron.core.tensor_parallel.random._get_cuda_rng_state",
    "CudaRNGStatesTracker.fork reads CUDA default_generators directly",
)
def _tp_get_rng_state(_original):
    def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()
    return _get_cuda_rng_state


@register(
    "megatron.core.tensor_parallel.random._set_cuda_rng_state",
    "CudaRNGStatesTracker.fork writes CUDA default_generators directly",
)
def _tp_set_rng_state(_original):
    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)
    return _set_cuda_rng_state


# ---------------------------------------------------------------- streams, events, memory statistics

class NullStream:
    """Stand-in for torch.cuda.Stream: work on CPU is synchronous, so waits and syncs are no-ops (also the tests'
    torch_npu stand-in's streams, tests/helpers/npu_stand_in.py)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, _other):
        return None

    def wait_event(self, _event):
        return None

    def record_event(self, event=None):
        return event if event is not None else NullEvent()

    def synchronize(self):
        return None

    def query(self):
        return True


class NullEvent:
    """Stand-in for torch.cuda.Event; elapsed_time uses wall clock so inference timing logs stay sane."""

    def __init__(self, *args, **kwargs):
        self._t = None

    def record(self, _stream=None):
        import time

        self._t = time.perf_counter()

    def synchronize(self):
        return None

    def wait(self, _stream=None):
        return None

    def query(self):
        return True

    def elapsed_time(self, end):
        if self._t is None or end._t is None:
            return 0.0
        return (end._t - self._t) * 1000.0


@register("torch.cuda.Stream", "pipeline/DDP overlap code creates side streams")
def _stream_cls(_original):
    return type("Stream", (NullStream,), {})


@register("torch.cuda.Event", "the inference controller and timers record CUDA events")
def _event_cls(_original):
    return type("Event", (NullEvent,), {})


@register("torch.cuda.current_stream", "overlap code waits on the current stream")
def _current_stream(_original):
    def current_stream(_device=None):
        return NullStream()
    return current_stream


@register("torch.cuda.default_stream", "overlap code waits on the default stream")
def _default_stream(_original):
    def default_stream(_device=None):
        return NullStream()
    return default_stream


@register("torch.cuda.stream", "`with torch.cuda.stream(s):` blocks around side-stream work")
def _stream_ctx(_original):
    def stream(_stream=None):
        return contextlib.nullcontext()
    return stream


def _zero_stat(name):
    def stat(*_args, **_kwargs):
        return 0
    stat.__name__ = name
    return stat


for _stat in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
    register(f"torch.cuda.{_stat}", "memory reports read CUDA allocator stats; zero on CPU")(
        lambda _original, _name=_stat: _zero_stat(_name)
    )


@register("torch.cuda.reset_peak_memory_stats", "memory reports reset CUDA allocator stats")
def _reset_peak(_original):
    def reset_peak_memory_stats(_device=None):
        return None
    return reset_peak_memory_stats


@register("torch.cuda.memory_stats", "memory reports read CUDA allocator stats")
def _memory_stats(_original):
    def memory_stats(_device=None):
        return {}
    return memory_stats


@register(
    "torch.Tensor.cuda",
    "language_module (tied embeddings at PP>1) and the inference controller call .cuda(); on a CPU-only "
    "process that call can only fail, so it returns the tensor itself",
)
def _tensor_cuda(_original):
    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self
    return cuda


# ---------------------------------------------------------------- device='cuda' tensor creation

def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return CPU
    return device


def _factory(fn):
    def make(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)
    make.__name__ = fn.__name__
    return make


class _TorchOnCpu(types.ModuleType):
    """`torch` as seen by one megatron module: the same module, except that the tensor factories map
    `device='cuda'` to the CPU. Installed as that module's global `torch`, so nothing else is affected."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like")

    def __init__(self):
        super().__init__("torch")
        for name in self._FACTORIES:
            setattr(self, name, _factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


for _module in (
    "megatron.core.optimizer.optimizer",  # found_inf / _scale / _dummy_overflow_buf with device='cuda'
    "megatron.core.optimizer.clip_grads",  # grad-norm and zero-count accumulators
    "megatron.core.optimizer.grad_scaler",  # fp16 loss scale tensors
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens counters
    "megatron.core.tensor_parallel.data",  # broadcast_data size buffers
    "megatron.core.inference.text_generation_controllers.text_generation_controller",
):
    register(f"{_module}.torch", "this module builds tensors with device='cuda'")(
        lambda _original: _TorchOnCpu()
    )


def _causal_mask_on_cpu(_original):
    @functools.lru_cache(maxsize=32)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)
    return get_default_causal_mask


for _site in ("megatron.core.transformer.utils", "megatron.core.fusions.fused_softmax"):
    # fused_softmax imported the helper by name, so its own binding is patched too.
    register(f"{_site}.get_default_causal_mask", "the causal mask is built with device='cuda'")(
        _causal_mask_on_cpu
    )


@register(
    "megatron.core.optimizer.clip_grads.l2_norm_impl",
    "without TE/apex megatron falls back to local_multi_tensor_l2_norm, which returns a device='cuda' tensor",
)
def _l2_norm(_original):
    def multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        norms = [torch.linalg.vector_norm(t.float()) for tensor_list in tensor_lists for t in tensor_list]
        total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
        return total.reshape(1), None
    return multi_tensor_l2_norm


# ---------------------------------------------------------------- uneven all-gathers (gloo)

@register(
    "megatron.core.tensor_parallel.mappings._gather_along_first_dim",
    "with output_split_sizes (the alltoall MoE dispatcher at expert TP > 1, i.e. MoE under --sequence-parallel) it "
    "all-gathers tensors of different sizes, which gloo refuses: padded to the largest split, gathered, cut (exact)",
)
def _gather_along_first_dim(original):
    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        sizes = None if output_split_sizes is None else [int(n) for n in output_split_sizes]
        if sizes is None or group is None or group.size() == 1 or len(set(sizes)) == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        largest, rest = max(sizes), tuple(input_.shape[1:])
        padded = input_.new_zeros((largest, *rest))
        padded[:input_.size(0)] = input_
        gathered = input_.new_empty((largest * group.size(), *rest))
        torch.distributed.all_gather_into_tensor(gathered, padded, group=group)
        return torch.cat([gathered[r * largest:r * largest + n] for r, n in enumerate(sizes)])
    return gather_along_first_dim
