"""Patches for megatron-core 0.16.1's mixture-of-experts code without Transformer Engine (all devices).

`moe_utils.RouterGatingLinearFunction` (every router's logits, forward and backward) tests
`te_general_gemm is not None`, but the module binds that name only when Transformer Engine imports: without
TE the router raises NameError at the first forward. Binding it to None selects megatron's own torch.mm
path, which is what the code intends.
"""

from __future__ import annotations

from mindspeed_llm.patches import register


@register(
    "megatron.core.transformer.moe.moe_utils.te_general_gemm",
    "moe_utils reads te_general_gemm, bound only when Transformer Engine imports; None selects its torch path",
    devices=("cpu", "cuda", "npu"),
)
def _te_general_gemm(original):
    return original  # the TE kernel where it imported, else None (not a NameError)


@register(
    "megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu",
    "the all-to-all dispatcher's split sizes become numpy only for CUDA tensors; on CPU they stayed tensors, "
    "which all_to_all_single rejects",
)
def _maybe_move_tensor_to_cpu(original):
    import torch

    def move(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return move
