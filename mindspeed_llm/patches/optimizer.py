"""megatron-core 0.16.1's optimizers on devices whose tensors are not `torch.cuda.*` (cpu, npu).

`DistributedOptimizer.__init__` (and `_build_model_and_main_param_groups`, which it calls) sorts the model's
parameters by `param.type()`: 'torch.cuda.BFloat16Tensor' / 'torch.cuda.HalfTensor' get an fp32 main shard,
'torch.cuda.FloatTensor' is sharded in place, any other name is `TypeError: Wrapped parameters must be one of
torch.cuda.FloatTensor, ...`. A CPU tensor reads 'torch.FloatTensor', an NPU tensor 'torch.npu.FloatTensor', so
`--use-distributed-optimizer` stopped there. For the constructor only, `tensor.type()` answers with the CUDA name
of the same dtype; nothing after construction reads it.

Where one param group mixes fp32 and half-precision parameters (a bf16 critic keeps its value head in fp32), the
distributed optimizer's map from a parameter to its place in the inner optimizer is wrong, so its checkpoint
functions would move state between parameters; `_group_order` numbers them as the inner optimizer holds them (all
devices: the bug is megatron's, not a device's). Loading a checkpoint's main weights and moments
(`_set_main_param_and_optimizer_states`) expects Apex / TE's Adam, whose state has no `step`: `_set_states` copies
the checkpoint's keys only, under no_grad (an fp32 main param is a view of a parameter).

The same `param.type()` test stops two more places off CUDA (cpu, npu; moved here from `cpu.py` when the NPU lane,
tests/dist/test_npu_lane.py, ran into the first on the `torch_npu` stand-in): gradient clipping
(`clip_grad_by_total_norm_fp32` asserts 'torch.cuda.FloatTensor' grads; the replacement scales them in place) and
bf16 / fp16 training without the distributed optimizer (`Float16OptimizerWithFloat16Params.__init__`).

Nothing else is needed for gloo: the optimizer's reduce-scatter / all-gather (DDP) and the checkpoint's gather /
scatter (`get_parameter_state_dp_zero`, `load_parameter_state_from_dp_zero`, over megatron's gloo DP group) are
collectives gloo has (measured, shared/MEGATRON_ON_CPU.md).
"""

from __future__ import annotations

import contextlib

import torch

from mindspeed_llm.patches import register


def cuda_type_name(name: str) -> str:
    """'torch.FloatTensor' / 'torch.npu.FloatTensor' -> 'torch.cuda.FloatTensor' (a CUDA name stays)."""
    if name.startswith("torch.cuda."):
        return name
    kind = name.rsplit(".", 1)[-1]
    return f"torch.cuda.{kind}" if name.startswith("torch.") and kind.endswith("Tensor") else name


@contextlib.contextmanager
def cuda_type_names():
    """For the block, `tensor.type()` (no arguments) of any tensor reads as its CUDA counterpart's name."""
    real = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is not None or kwargs:
            return real(self, dtype, non_blocking, **kwargs)
        return cuda_type_name(real(self))

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = real


@register(
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.__init__",
    "it sorts parameters by `param.type()` and refuses any name but torch.cuda.{Float,Half,BFloat16}Tensor, so "
    "CPU and NPU tensors could not use --use-distributed-optimizer",
    devices=("cpu", "npu"),
)
def _distributed_optimizer_init(original):
    def __init__(self, *args, **kwargs):
        with cuda_type_names():
            original(self, *args, **kwargs)
    return __init__


@register(
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._build_optimizer_group_ranges",
    "it numbers each parameter within its param group in grad-buffer order, but the inner optimizer holds the "
    "group's fp32 shards first, then the fp32 copies of half-precision ones (_build_model_and_main_param_groups): "
    "where one group mixes both (a bf16 critic's fp32 value head) the checkpoint functions read and write another "
    "parameter's main weights and moments (RuntimeError: size mismatch in get_parameter_state_dp_zero)",
    devices=("cpu", "cuda", "npu"),
)
def _group_order(original):
    def build(cls, param_groups, gbuf_ranges):
        param_group_map, group_ranges = original(param_groups, gbuf_ranges)
        for group_index, group_range in enumerate(group_ranges):
            params = group_range["params"]
            inner_order = [p for p in params if p.dtype == torch.float32] + \
                [p for p in params if p.dtype != torch.float32]
            for order, param in enumerate(inner_order):
                param_group_map[param] = (group_index, order)
        return param_group_map, group_ranges
    return classmethod(build)


@register(
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states",
    "loading a checkpoint's main weights and moments copies every key of the parameter's optimizer state, and "
    "without Apex / Transformer Engine torch's Adam keeps its `step` there, which the checkpoint's tensors lack "
    "(KeyError: 'step'; megatron's load_state_dict has already set it); and it copies into fp32 main params that "
    "are views of the model's parameters outside no_grad (RuntimeError: a view of a leaf Variable that requires "
    "grad is being used in an in-place operation)",
    devices=("cpu", "cuda", "npu"),
)
def _set_states(original):
    def set_main_param_and_optimizer_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        targets = {"param": main_param, **self.optimizer.state[main_param]}
        with torch.no_grad():
            for key, value in tensors.items():
                targets[key].copy_(value)
    return set_main_param_and_optimizer_states


# ---------------------------------------------------------------- gradient clipping and bf16 / fp16 off CUDA

@register(
    "megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32",
    "the original asserts grad.type() == 'torch.cuda.FloatTensor' ('torch.FloatTensor' on CPU, "
    "'torch.npu.FloatTensor' on NPU) and needs apex's multi_tensor_scale",
    devices=("cpu", "npu"),
)
def _clip_grads(_original):
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff >= 1.0:
            return
        for param in parameters:
            grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
            if grad is not None:
                grad.detach().mul_(clip_coeff)
    return clip_grad_by_total_norm_fp32


@register(
    "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__",
    "it sorts parameters by `param.type()` ('torch.cuda.BFloat16Tensor' gets an fp32 main copy) and refuses "
    "any other name, so CPU ('torch.BFloat16Tensor') and NPU ('torch.npu.BFloat16Tensor') tensors could not train "
    "in bf16 / fp16",
    devices=("cpu", "npu"),
)
def _float16_optimizer_init(_original):
    def __init__(self, *args, **kwargs):
        with cuda_type_names():
            _original(self, *args, **kwargs)
    return __init__
