"""Sequence parallelism on megatron-core 0.16.1's local layer spec (all devices).

The local spec's norms are `WrappedTorchNorm` (torch's `RMSNorm` / `LayerNorm`), which asserts
`not config.sequence_parallel`: the torch norm itself is fine under sequence parallelism (it normalises each
token on its own), but its weight then sees only this TP rank's share of the sequence, so its gradient is a
partial sum. Megatron's answer for such weights (Transformer Engine's norms, the router) is the attribute
`param.sequence_parallel = True`, which `finalize_model_grads` reads to all-reduce their gradients over the TP
group. The patch builds the torch norm as megatron would without sequence parallelism and marks its parameters
so. Measured (shared/MEGATRON_ON_CPU.md): without the marking the loss drifts by 2e-5 after a step at TP2 (the
norms train on half the tokens); with it TP2 + SP equals the single-process run. The q / k norms of Qwen3 are
built by the same class: megatron already sums their gradients over TP (`qk_layernorm`), and the marking selects
the same sum, once.
"""

from __future__ import annotations

import copy

from mindspeed_llm.patches import register


@register(
    "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__",
    "the local spec's torch norm asserts no sequence parallelism; built without it and its parameters marked "
    "sequence_parallel, finalize_model_grads all-reduces their gradients over TP as for megatron's own norms",
    devices=("cpu", "cuda", "npu"),
)
def _wrapped_torch_norm_new(original):
    def new(cls, config, hidden_size, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return original(cls, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)  # the norm reads its kind and checks; the model keeps the shared config
        plain.sequence_parallel = False
        norm = original(cls, plain, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return staticmethod(new)
