"""The actor's tensors as the weight stream sees them: named by their place in the whole model (global layer
indices, PP 1), each with the checkpoint rule that splits it over tensor parallelism, and resharded from the
trainers' TP slices to a generator's TP slice.

The split rules are the checkpoint code's (`checkpoint/sharding.py` `tp_rule`, `split_tensor`, `merge_tensor`;
adapters: `checkpoint/lora.py` `split_rule`), not written again here: megatron's `tensor_model_parallel` /
`partition_dim` attributes say which dim a parameter is split on, but not that SwiGLU's fc1 holds [gate ; up]
halves split separately (a plain concatenation of fc1's TP slices is wrong at TP > 1), so the name decides and
the attributes are checked against it (`attribute_problem`). QKV's rows are grouped per key/value head, so its
contiguous TP chunks are whole groups and a plain split is right (the checkpoint code's own reading).

LoRA actors stream their adapters only (`<module>.lora.A` / `.lora.B`, `checkpoint/lora.py`'s names): a
column-parallel module's A is replicated and its B split like the module's weight; a row-parallel module's A is
split on its columns and its B replicated. Mixtures of experts are refused by name (expert parallelism and
expert TP are not streamed yet).
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from mindspeed_llm.checkpoint import lora as lora_files
from mindspeed_llm.checkpoint import sharding
from mindspeed_llm.checkpoint.megatron_names import LAYER_PREFIX, OUTPUT
from mindspeed_llm.errors import UserError

REPLICATED = ""  # the split name of a tensor every TP rank holds whole
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SPLIT_DIM = {"vocab": 0, "column": 0, "fc1": 0, "row": 1}


class WeightSyncError(UserError):
    """The trainers' and a generator's actors do not fit each other, or a sync broke its protocol."""


def split_name(name: str) -> str:
    """The name whose checkpoint TP rule splits tensor `name` (global or local), or REPLICATED."""
    module = lora_files.module_of(name)
    if module is not None:
        row = lora_files.split_rule(module) == "row"
        split_a = name.endswith(lora_files.A_SUFFIX)
        return module + ".weight" if split_a == row else REPLICATED
    if sharding.is_expert(name):
        raise WeightSyncError(f"{name}: a mixture-of-experts actor is not streamed to generator ranks yet "
                              "(expert parallelism and expert TP); run it without --rollout-world-size")
    return REPLICATED if sharding.tp_rule(name) == "replicated" else name


def split_dim(rule_name: str) -> Optional[int]:
    """The dim `rule_name`'s slices are cut on; None when replicated."""
    return None if rule_name == REPLICATED else _SPLIT_DIM[sharding.tp_rule(rule_name)]


def attribute_problem(name: str, param: torch.Tensor) -> Optional[str]:
    """Megatron's tensor-parallel attributes of `param` against the rule its name gives (None when they agree or
    the parameter carries none)."""
    parallel = getattr(param, "tensor_model_parallel", None)
    if parallel is None or lora_files.module_of(name) is not None:
        return None
    dim = split_dim(split_name(name))
    if not parallel:
        return None if dim is None else f"{name}: megatron marks it replicated, its name splits it on dim {dim}"
    if dim is None:
        return f"{name}: megatron marks it split on dim {param.partition_dim}, its name says replicated"
    if param.partition_dim != dim:
        return f"{name}: megatron splits it on dim {param.partition_dim}, its name on dim {dim}"
    return None


def global_name(local: str, layer_offset: int) -> str:
    """A pipeline stage's local name -> the whole model's (layer index + the stage's first layer)."""
    match = _LAYER.match(local)
    if not match:
        return local
    return f"{LAYER_PREFIX}{int(match.group(1)) + layer_offset}.{match.group(2)}"


def model_tensors(model) -> Dict[str, torch.Tensor]:
    """{global name: this rank's tensor} of what a sync carries from `model` (a megatron GPTModel, wrapped or not):
    a LoRA model's adapters only; else its parameters, less a pipeline's last-stage copy of tied embeddings (the
    first stage sends the embedding). Megatron's TP attributes are checked against the names' rules."""
    from megatron.core.utils import unwrap_model

    from mindspeed_llm.models import lora

    core = unwrap_model(model)
    if lora.is_lora(core):
        out = {}
        for module, (a, b) in lora.adapter_tensors(core).items():
            out[module + lora_files.A_SUFFIX], out[module + lora_files.B_SUFFIX] = a, b
        for name in out:
            split_name(name)  # refuses experts by name
        return out
    decoder = getattr(core, "decoder", None)
    offset = decoder.layers[0].layer_number - 1 if decoder is not None and len(decoder.layers) else 0
    tied_copy = getattr(core, "share_embeddings_and_output_weights", False) and not getattr(core, "pre_process", True)
    out, problems = {}, []
    for local, param in core.named_parameters():
        if tied_copy and local == OUTPUT:
            continue
        name = global_name(local, offset)
        problem = attribute_problem(name, param)
        if problem:
            problems.append(problem)
        out[name] = param
    if problems:
        raise WeightSyncError("the actor's tensor-parallel layout disagrees with the checkpoint rules: "
                              + "; ".join(problems[:4]))
    return out


# ------------------------------------------------------------------------------------------- resharding

def full_shape(rule_name: str, part_shape: Sequence[int], tp: int) -> Tuple[int, ...]:
    """The unsplit shape of a tensor whose TP slices (of `tp`) have `part_shape`."""
    shape = list(part_shape)
    dim = split_dim(rule_name)
    if dim is not None:
        shape[dim] *= tp
    return tuple(shape)


def local_shape(rule_name: str, shape: Sequence[int], tp: int) -> Tuple[int, ...]:
    """The shape of one TP slice (of `tp`) of a full tensor of `shape`; WeightSyncError when it does not divide."""
    out = list(shape)
    dim = split_dim(rule_name)
    if dim is not None:
        if out[dim] % tp:
            raise WeightSyncError(f"{rule_name}: {out[dim]} rows/columns on dim {dim} do not divide over the "
                                  f"generators' TP={tp}")
        out[dim] //= tp
    return tuple(out)


def parts_needed(rule_name: str, source_tp: int) -> int:
    """How many TP slices of the trainers make the full tensor: one for a replicated tensor (TP rank 0 sends it)."""
    return 1 if rule_name == REPLICATED else source_tp


def reshard(rule_name: str, parts: List[torch.Tensor], tp: int, rank: int) -> torch.Tensor:
    """The slice of TP rank `rank` of `tp` from the trainers' TP slices `parts` (in TP-rank order): the
    checkpoint code's merge, then its split."""
    if rule_name == REPLICATED:
        return parts[0]
    full = sharding.merge_tensor(rule_name, parts) if len(parts) > 1 else parts[0]
    if tp == 1:
        return full
    return sharding.split_tensor(rule_name, full, tp)[rank]


def plan_buckets(sizes: Iterable[int], bucket_bytes: int) -> List[List[int]]:
    """Indices of tensors of `sizes` bytes grouped in order into buckets of at most `bucket_bytes`; a tensor
    larger than a bucket travels alone."""
    if bucket_bytes <= 0:
        raise WeightSyncError(f"the weight-sync bucket size must be positive, not {bucket_bytes} bytes")
    buckets: List[List[int]] = []
    filled = bucket_bytes  # start a new bucket on the first tensor
    for index, size in enumerate(sizes):
        if filled + size > bucket_bytes or not buckets:
            buckets.append([])
            filled = 0
        buckets[-1].append(index)
        filled += size
    return buckets

