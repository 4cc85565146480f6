"""Tensor- and pipeline-parallel split / merge of Megatron-core (local spec GPTModel) state dicts.

Vocabulary: a *full* state dict holds unsplit tensors under global layer indices
(`decoder.layers.{0..L-1}`), without `_extra_state` entries and without the tied output copy; a *shard*
is what one (tp_rank, pp_rank) GPTModel's `state_dict()` holds: layer indices local to its pipeline stage
(stage p holds global layers [p*L/PP, (p+1)*L/PP), renumbered from 0), TP slices, and `_extra_state`
entries (None) for megatron's parallel linears.

TP rules (measured against GPTModel, see tests/test_models_parity.py):
- vocab-parallel, split on dim 0: word embeddings, output layer;
- column-parallel, split on dim 0: linear_qkv weight and bias (its rows are grouped per key/value head,
  so contiguous chunks are whole groups), linear_fc1 with [gate ; up] split separately (rank r holds
  [gate_r ; up_r]);
- row-parallel, split on dim 1: linear_proj, linear_fc2;
- replicated: every norm, the value head.

PP rules: the embedding lives on the first stage; the final norm and the output layer on the last. With
tied embeddings and PP > 1 megatron gives the last stage its own `output_layer.weight`, initialised as a
copy of the first stage's word embeddings (kept equal in training by the embedding-group all-reduce):
shards carry that copy; merging takes the first stage's embedding. With PP == 1 a tied model has no
`output_layer.weight` (only its `_extra_state`). A value head (`output_layer.weight` [1, hidden], fp32)
is never tied.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

import torch

from mindspeed_llm.checkpoint.hf_mapping import EMBED, FINAL_NORM, LAYER_PREFIX, OUTPUT, ConversionError

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
EXTRA_STATE = "_extra_state"

# Parallel linears whose modules define `_extra_state` (None in the local spec).
_LINEARS_WITH_EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                             "mlp.linear_fc2")

_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_COLUMN_PARALLEL = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
_FC1 = "mlp.linear_fc1.weight"
_REPLICATED = ("input_layernorm.weight", "pre_mlp_layernorm.weight", "self_attention.q_layernorm.weight",
               "self_attention.k_layernorm.weight")


def is_extra_state(name: str) -> bool:
    return name.endswith(EXTRA_STATE)


# ------------------------------------------------------------------------------------------- tensor parallel

def tp_rule(name: str, value_head: bool = False) -> str:
    """'vocab' | 'column' | 'fc1' | 'row' | 'replicated' for a Megatron name (global or local)."""
    if name == EMBED:
        return "vocab"
    if name == OUTPUT:
        return "replicated" if value_head else "vocab"
    if name == FINAL_NORM:
        return "replicated"
    match = _LAYER_RE.match(name)
    rel = match.group(2) if match else name
    if rel in _COLUMN_PARALLEL:
        return "column"
    if rel == _FC1:
        return "fc1"
    if rel in _ROW_PARALLEL:
        return "row"
    if rel in _REPLICATED:
        return "replicated"
    raise ConversionError(f"no tensor-parallel rule for Megatron tensor {name!r}")


def split_tensor(name: str, tensor: torch.Tensor, tp: int, value_head: bool = False) -> List[torch.Tensor]:
    """The `tp` slices of one full tensor (each an independent copy, so saving one saves only its bytes)."""
    rule = tp_rule(name, value_head)
    if tp == 1 or rule == "replicated":
        return [tensor.clone() for _ in range(tp)]
    if rule in ("vocab", "column"):
        parts = _chunk(name, tensor, tp, 0)
    elif rule == "row":
        parts = _chunk(name, tensor, tp, 1)
    else:  # fc1: [gate ; up], each half split separately
        gate, up = torch.chunk(tensor, 2, dim=0)
        parts = [torch.cat([g, u], dim=0) for g, u in zip(_chunk(name, gate, tp, 0), _chunk(name, up, tp, 0))]
    return [p.clone() for p in parts]


def _chunk(name, tensor, tp, dim):
    if tensor.shape[dim] % tp:
        raise ConversionError(f"{name} has {tensor.shape[dim]} rows/columns on dim {dim}: not divisible by TP={tp}")
    return list(torch.chunk(tensor, tp, dim=dim))


def merge_tensor(name: str, parts: List[torch.Tensor], value_head: bool = False) -> torch.Tensor:
    """Inverse of `split_tensor`."""
    rule = tp_rule(name, value_head)
    if len(parts) == 1 or rule == "replicated":
        return parts[0]
    if rule in ("vocab", "column"):
        return torch.cat(parts, dim=0)
    if rule == "row":
        return torch.cat(parts, dim=1)
    halves = [torch.chunk(p, 2, dim=0) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


# ------------------------------------------------------------------------------------------- pipeline parallel

def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Global layer indices held by pipeline `stage`."""
    per = num_layers // pp
    return range(stage * per, (stage + 1) * per)


def stage_of(name: str, num_layers: int, pp: int) -> Optional[int]:
    """The stage holding global tensor `name` (the output layer: the last; a tied copy is not asked for)."""
    if name == EMBED:
        return 0
    if name in (FINAL_NORM, OUTPUT):
        return pp - 1
    match = _LAYER_RE.match(name)
    if not match:
        raise ConversionError(f"unexpected Megatron tensor {name!r}")
    return int(match.group(1)) // (num_layers // pp)


def to_local(name: str, num_layers: int, pp: int) -> str:
    match = _LAYER_RE.match(name)
    if not match:
        return name
    return f"{LAYER_PREFIX}{int(match.group(1)) % (num_layers // pp)}.{match.group(2)}"


def to_global(name: str, stage: int, num_layers: int, pp: int) -> str:
    match = _LAYER_RE.match(name)
    if not match:
        return name
    return f"{LAYER_PREFIX}{int(match.group(1)) + stage * (num_layers // pp)}.{match.group(2)}"


def expected_local_names(spec, pp: int, stage: int, value_head: bool, extra_state: bool = False) -> List[str]:
    """The tensor names a (stage, any TP rank) GPTModel holds, in its state_dict order."""
    from mindspeed_llm.checkpoint.hf_mapping import mg_layer_names

    names = []
    if stage == 0:
        names.append(EMBED)
    per = spec.num_layers // pp
    for i in range(per):
        for rel in mg_layer_names(spec):
            names.append(f"{LAYER_PREFIX}{i}.{rel}")
        if extra_state:
            names += [f"{LAYER_PREFIX}{i}.{lin}.{EXTRA_STATE}" for lin in _LINEARS_WITH_EXTRA_STATE]
    if stage == pp - 1:
        names.append(FINAL_NORM)
        if value_head or not spec.tie_word_embeddings or pp > 1:
            names.append(OUTPUT)
        if extra_state and not value_head:
            names.append(f"output_layer.{EXTRA_STATE}")
    return names


def stage_state_dict(full: Dict[str, torch.Tensor], spec, pp: int, stage: int, value_head: bool) -> Dict[str, torch.Tensor]:
    """The part of a full (global, unsplit) state dict that `stage` holds, renamed to local indices.

    `full` may hold only this stage's tensors (streaming conversion); missing ones raise.
    """
    out = {}
    for name in expected_local_names(spec, pp, stage, value_head):
        if name == OUTPUT and spec.tie_word_embeddings and not value_head:
            source = EMBED  # the last stage's copy of the tied word embeddings (PP > 1 only)
        elif name.startswith(LAYER_PREFIX):
            source = to_global(name, stage, spec.num_layers, pp)
        else:
            source = name
        if source not in full:
            raise ConversionError(f"Megatron tensor {source} (for pipeline stage {stage}) is missing")
        out[name] = full[source]
    return out


def split_stage(stage_sd: Dict[str, torch.Tensor], tp: int, value_head: bool, with_extra_state: bool = True,
                spec=None, pp: int = 1, stage: int = 0) -> List[Dict[str, Optional[torch.Tensor]]]:
    """One stage's unsplit tensors -> the `tp` shards (in GPTModel state_dict order, `_extra_state` = None)."""
    shards: List[Dict[str, Optional[torch.Tensor]]] = [{} for _ in range(tp)]
    order = (expected_local_names(spec, pp, stage, value_head, extra_state=with_extra_state)
             if spec is not None else list(stage_sd))
    for name in order:
        if is_extra_state(name):
            for shard in shards:
                shard[name] = None
            continue
        for shard, part in zip(shards, split_tensor(name, stage_sd[name], tp, value_head)):
            shard[name] = part
    return shards


def merge_stage(shards: List[Dict[str, torch.Tensor]], value_head: bool) -> Dict[str, torch.Tensor]:
    """The TP shards of one stage -> unsplit tensors (local names, `_extra_state` dropped)."""
    names = [n for n in shards[0] if not is_extra_state(n)]
    for rank, shard in enumerate(shards[1:], start=1):
        other = [n for n in shard if not is_extra_state(n)]
        if set(other) != set(names):
            diff = sorted(set(other) ^ set(names))
            raise ConversionError(f"tensor-parallel rank {rank} holds different tensors than rank 0: {diff[:5]}")
    return {n: merge_tensor(n, [s[n] for s in shards], value_head) for n in names}


def stage_to_full(stage_sd: Dict[str, torch.Tensor], spec, pp: int, stage: int, value_head: bool) -> Dict[str, torch.Tensor]:
    """Unsplit local tensors of one stage -> global names; the last stage's tied embedding copy is dropped."""
    out = {}
    for name, tensor in stage_sd.items():
        if name == OUTPUT and spec.tie_word_embeddings and not value_head:
            continue  # the copy of the first stage's word embeddings
        out[to_global(name, stage, spec.num_layers, pp)] = tensor
    return out


def split_model(full: Dict[str, torch.Tensor], spec, tp: int, pp: int, value_head: bool,
                with_extra_state: bool = True) -> Dict[Tuple[int, int], Dict[str, Optional[torch.Tensor]]]:
    """A full state dict -> {(tp_rank, pp_rank): shard}."""
    spec.check_parallel(tp, pp)
    out = {}
    for stage in range(pp):
        stage_sd = stage_state_dict(full, spec, pp, stage, value_head)
        for rank, shard in enumerate(split_stage(stage_sd, tp, value_head, with_extra_state, spec, pp, stage)):
            out[(rank, stage)] = shard
    return out


def merge_model(shards: Dict[Tuple[int, int], Dict[str, torch.Tensor]], spec, tp: int, pp: int,
                value_head: bool) -> Dict[str, torch.Tensor]:
    """{(tp_rank, pp_rank): shard} -> a full state dict."""
    full = {}
    for stage in range(pp):
        stage_sd = merge_stage([shards[(r, stage)] for r in range(tp)], value_head)
        full.update(stage_to_full(stage_sd, spec, pp, stage, value_head))
    return full
