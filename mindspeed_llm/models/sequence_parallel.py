"""Sequence parallelism (`--sequence-parallel`, TP > 1) outside the training forwards: generation runs without it.

Under megatron's sequence parallelism the activations between the tensor-parallel regions (norms, residuals,
dropout: 21 H of a layer's 29 H bytes per token in bf16) are split along the sequence over the TP ranks, so every
forward needs a sequence length divisible by TP. The training forwards and the log-prob / value / reward passes
pad their micro-batches to such a width (`rl/update/engine.py`). The rollout's decode steps run one token per row, and
megatron's static KV-cache path reads the last position of the local sequence shard (`hidden_states[-1:]`), which
under sequence parallelism is not the last token. So `generate` runs the model with sequence parallelism off for
its duration (`sequence_parallel_off`): the linear layers all-reduce instead of reduce-scattering and
all-gathering, the embedding all-reduces, `config.sequence_parallel` reads False; the weights are the same, and so
is the result (the same sums in another order of communication). Generation keeps no activations for backward, so
the replicated activations cost only the transient working set of one forward.
"""

from __future__ import annotations

import contextlib

from megatron.core.utils import unwrap_model


def is_sequence_parallel(model) -> bool:
    """Whether `model` (possibly wrapped) runs megatron's sequence parallelism now."""
    return bool(getattr(unwrap_model(model).config, "sequence_parallel", False))


@contextlib.contextmanager
def sequence_parallel_off(model):
    """Within the block, `model` runs as a plain tensor-parallel model (no-op without sequence parallelism)."""
    core = unwrap_model(model)
    if not is_sequence_parallel(core):
        yield model
        return
    changed = []  # (object, attribute, previous value)
    configs = {id(core.config): core.config}
    for module in core.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "sequence_parallel"):
            configs[id(config)] = config
        # ColumnParallelLinear / RowParallelLinear read `self.sequence_parallel`, the embeddings
        # `reduce_scatter_embeddings`, at every forward
        for attr in ("sequence_parallel", "reduce_scatter_embeddings"):
            if getattr(module, attr, None) is True:
                changed.append((module, attr, True))
    changed += [(config, "sequence_parallel", True) for config in configs.values() if config.sequence_parallel]
    for obj, attr, _ in changed:
        setattr(obj, attr, False)
    try:
        yield model
    finally:
        for obj, attr, value in reversed(changed):
            setattr(obj, attr, value)
