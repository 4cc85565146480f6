"""megatron-core 0.16.1's distributed optimizer on devices whose tensors are not `torch.cuda.*` (cpu, npu).

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
