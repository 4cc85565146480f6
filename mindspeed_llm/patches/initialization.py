"""Megatron's tensor-parallel parameter attributes for models built without random initialisation (all devices).

megatron-core 0.16.1's `VocabParallelEmbedding`, `ColumnParallelLinear` and `RowParallelLinear` mark their weight
as tensor-parallel (`tensor_model_parallel`, `partition_dim`, `partition_stride`) inside `_initialize_affine_weight_*`,
which they call only when `config.perform_initialization` is on. A model built to be loaded from a checkpoint
(`perform_initialization=False`, `rl/update/roles.from_checkpoint`) then has unmarked weights, and megatron treats each
unmarked weight as a duplicate on every TP rank: the gradient norm counts the sharded weights of TP rank 0 only, so
at TP > 1 gradient clipping (and the logged grad_norm) came out wrong (the TP2 cases of
tests/dist/test_stages_layout_invariance.py caught it). The patch marks the weight as those functions would have,
after the constructor, when it did not:
the same attributes, nothing else.
"""

from __future__ import annotations

import inspect

from mindspeed_llm.patches import register

_DEVICES = ("cpu", "cuda", "npu")


def _marking(original, partition_dim: int):
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        weight = getattr(self, "weight", None)
        bound = signature.bind_partial(self, *args, **kwargs).arguments
        config = bound.get("config")
        if weight is None or getattr(config, "perform_initialization", True) or \
                hasattr(weight, "tensor_model_parallel"):
            return
        stride = bound.get("stride", 1)
        set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)

    __init__.__wrapped__ = original
    return __init__


@register("megatron.core.tensor_parallel.layers.VocabParallelEmbedding.__init__",
          "without perform_initialization the embedding's weight is not marked tensor-parallel (vocabulary split)",
          devices=_DEVICES)
def _vocab_parallel_embedding(original):
    return _marking(original, 0)


@register("megatron.core.tensor_parallel.layers.ColumnParallelLinear.__init__",
          "without perform_initialization the weight is not marked tensor-parallel (output split)", devices=_DEVICES)
def _column_parallel_linear(original):
    return _marking(original, 0)


@register("megatron.core.tensor_parallel.layers.RowParallelLinear.__init__",
          "without perform_initialization the weight is not marked tensor-parallel (input split)", devices=_DEVICES)
def _row_parallel_linear(original):
    return _marking(original, 1)
