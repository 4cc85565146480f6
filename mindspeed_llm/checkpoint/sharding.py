"""Tensor- and pipeline-parallel split / merge of Megatron-core (local spec GPTModel) state dicts.

Vocabulary: a *full* state dict holds unsplit tensors under global layer indices
(`decoder.layers.{0..L-1}`), without `_extra_state` entries and without the tied output copy; a *shard*
is what one (tp_rank, pp_rank) GPTModel's `state_dict()` holds: layer indices local to its pipeline stage
(stage p holds global layers [p*L/PP, (p+1)*L/PP), renumbered from 0), TP slices, and `_extra_state`
entries (None) for megatron's parallel linears.

TP rules (measured against GPTModel, see tests/dist/test_models_parity.py):
- vocab-parallel, split on dim 0: word embeddings, output layer;
- column-parallel, split on dim 0: linear_qkv weight and bias (its rows are grouped per key/value head,
  so contiguous chunks are whole groups), linear_fc1 with [gate ; up] split separately (rank r holds
  [gate_r ; up_r]);
- row-parallel, split on dim 1: linear_proj, linear_fc2;
- replicated: every norm, the value head.

Mixture of experts (MoE layers): the router weight and the shared expert's gate are replicated; the shared
expert splits like a dense MLP (fc1 [gate ; up], fc2 on dim 1); each routed expert splits like a dense MLP
over the *expert* tensor-parallel size `etp` (1: whole; == TP: expert TP rank == TP rank). Expert parallelism
(`ep` ranks) gives expert-parallel rank e the experts [e*E/ep, (e+1)*E/ep) under local indices 0..E/ep-1
(megatron's numbering). A shard is then keyed (tp_rank, pp_rank, ep_rank) and holds the dense part of its
tp_rank and the experts of its ep_rank (the expert-TP slice of its tp_rank when etp == TP). Which
(tp_rank, ep_rank) pairs exist is `megatron_layout.expected_shards`'s business.

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

from mindspeed_llm.checkpoint.errors import ConversionError
from mindspeed_llm.checkpoint.megatron_names import (EMBED, EXPERT_BIAS, EXPERT_RE, FINAL_NORM, LAYER_PREFIX,
                                                     MOE_ROUTER, OUTPUT, SHARED_FC1, SHARED_FC2, SHARED_GATE,
                                                     expert_name, is_moe_layer, mg_layer_names, mla_attention_names)

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
EXTRA_STATE = "_extra_state"

_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight", SHARED_FC2)
# Multi-latent attention's projections are all column-parallel in the local spec, the down projections too
# (their output rows split over TP and gathered again); each up projection's rows are whole heads.
_MLA_COLUMN = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_q_up_proj.weight",
               "self_attention.linear_q_proj.weight", "self_attention.linear_kv_down_proj.weight",
               "self_attention.linear_kv_up_proj.weight")
_COLUMN_PARALLEL = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias") + _MLA_COLUMN
_FC1 = ("mlp.linear_fc1.weight", SHARED_FC1)
_REPLICATED = ("input_layernorm.weight", "pre_mlp_layernorm.weight", "self_attention.q_layernorm.weight",
               "self_attention.k_layernorm.weight", "self_attention.kv_layernorm.weight", MOE_ROUTER, EXPERT_BIAS,
               SHARED_GATE)


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
    if rel in _FC1:
        return "fc1"
    if rel in _ROW_PARALLEL:
        return "row"
    expert = EXPERT_RE.match(rel)
    if expert:  # split over the expert tensor-parallel size, like a dense MLP
        return "fc1" if expert.group(2) == "linear_fc1" else "row"
    if rel in _REPLICATED:
        return "replicated"
    raise ConversionError(f"no tensor-parallel rule for Megatron tensor {name!r}")


def split_tensor(name: str, tensor: torch.Tensor, tp: int, value_head: bool = False) -> List[torch.Tensor]:
    """The `tp` slices of one full tensor (each an independent copy, so saving one saves only its bytes).
    Routed experts are split by the caller's expert-TP size passed as `tp`."""
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
        what = "expert TP" if is_expert(name) else "TP"
        raise ConversionError(
            f"{name} has {tensor.shape[dim]} rows/columns on dim {dim}: not divisible by {what}={tp}")
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


def to_global(name: str, stage: int, num_layers: int, pp: int) -> str:
    match = _LAYER_RE.match(name)
    if not match:
        return name
    return f"{LAYER_PREFIX}{int(match.group(1)) + stage * (num_layers // pp)}.{match.group(2)}"


def is_expert(name: str) -> bool:
    """A routed expert's tensor (global or local layer name)."""
    match = _LAYER_RE.match(name)
    return bool(EXPERT_RE.match(match.group(2) if match else name))


def expert_index(name: str) -> Optional[int]:
    """The expert index j of `decoder.layers.i.mlp.experts.local_experts.j....`; None for other tensors."""
    match = _LAYER_RE.match(name)
    expert = EXPERT_RE.match(match.group(2)) if match else None
    return int(expert.group(1)) if expert else None


def with_expert_index(name: str, j: int) -> str:
    match = _LAYER_RE.match(name)
    expert = EXPERT_RE.match(match.group(2))
    return f"{LAYER_PREFIX}{match.group(1)}.{expert_name(j, expert.group(2), expert.group(3))}"


def _extra_state_linears(spec, index: int, num_experts: Optional[int]) -> List[str]:
    """The parallel linears of global layer `index` (they carry an `_extra_state`, None in the local spec)."""
    if spec.is_mla:
        linears = [mg[:-len(".weight")] for mg in mla_attention_names(spec) if "layernorm" not in mg]
    else:
        linears = ["self_attention.linear_qkv", "self_attention.linear_proj"]
    if not is_moe_layer(spec, index):
        return linears + ["mlp.linear_fc1", "mlp.linear_fc2"]
    for j in range(spec.num_experts if num_experts is None else num_experts):
        linears += [f"mlp.experts.local_experts.{j}.linear_fc1", f"mlp.experts.local_experts.{j}.linear_fc2"]
    if spec.moe_shared_expert_intermediate_size:
        linears += ["mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"]
    return linears


def expected_local_names(spec, pp: int, stage: int, value_head: bool, extra_state: bool = False,
                         ep: int = 1) -> List[str]:
    """The tensor names a (stage, any TP rank, any EP rank of `ep`) GPTModel holds, in its state_dict order
    (experts under local indices); `ep` == 1: all experts (the full stage, global indices)."""
    local = spec.num_experts // ep if spec.is_moe else None
    names = []
    if stage == 0:
        names.append(EMBED)
    per = spec.num_layers // pp
    for i in range(per):
        index = stage * per + i
        for rel in mg_layer_names(spec, index, local):
            names.append(f"{LAYER_PREFIX}{i}.{rel}")
        if extra_state:
            names += [f"{LAYER_PREFIX}{i}.{lin}.{EXTRA_STATE}" for lin in _extra_state_linears(spec, index, local)]
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
    """One stage's unsplit tensors -> the `tp` shards (in GPTModel state_dict order, `_extra_state` = None);
    experts (if any) whole and all in every shard (EP 1, expert TP 1 when tp == 1)."""
    if spec is not None and spec.is_moe and tp > 1:
        raise ConversionError("split_stage: a mixture of experts at TP > 1 needs split_stage_experts (expert TP)")
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


def split_stage_experts(stage_sd: Dict[str, torch.Tensor], spec, pp: int, stage: int, tp: int, ep: int, etp: int,
                        pairs, value_head: bool, with_extra_state: bool = True
                        ) -> Dict[Tuple[int, int], Dict[str, Optional[torch.Tensor]]]:
    """One stage's unsplit tensors (experts under global indices) -> {(tp_rank, ep_rank): shard} for the
    (tp_rank, ep_rank) `pairs` asked for. Shard (t, e) holds the dense TP slice t and the experts of
    expert-parallel rank e under local indices, split over `etp` (slice t when etp == tp, whole when 1)."""
    if etp not in (1, tp):
        raise ConversionError(f"expert tensor-parallel size {etp} must be 1 or the TP size {tp}")
    local = spec.num_experts // ep if spec.is_moe else 0
    order = expected_local_names(spec, pp, stage, value_head, extra_state=with_extra_state, ep=ep)
    dense_parts: Dict[str, List[torch.Tensor]] = {}
    shards = {}
    for e in sorted({e for _, e in pairs}):
        expert_parts: Dict[str, List[torch.Tensor]] = {}  # this EP rank's experts, split once for all its tp ranks
        for t in sorted(t for t, e2 in pairs if e2 == e):
            shard: Dict[str, Optional[torch.Tensor]] = {}
            for name in order:
                if is_extra_state(name):
                    shard[name] = None
                    continue
                j = expert_index(name)
                if j is None:
                    if name not in dense_parts:
                        dense_parts[name] = split_tensor(name, stage_sd[name], tp, value_head)
                    shard[name] = dense_parts[name][t]
                    continue
                source = stage_sd[with_expert_index(name, e * local + j)]
                if etp == 1:
                    shard[name] = source
                    continue
                if name not in expert_parts:
                    expert_parts[name] = split_tensor(name, source, etp)
                shard[name] = expert_parts[name][t]
            shards[(t, e)] = shard
    return {pair: shards[pair] for pair in pairs}


def merge_stage(shards: List[Dict[str, torch.Tensor]], value_head: bool) -> Dict[str, torch.Tensor]:
    """The TP shards of one stage -> unsplit tensors (local names, `_extra_state` dropped)."""
    names = [n for n in shards[0] if not is_extra_state(n)]
    for rank, shard in enumerate(shards[1:], start=1):
        other = [n for n in shard if not is_extra_state(n)]
        if set(other) != set(names):
            diff = sorted(set(other) ^ set(names))
            raise ConversionError(f"tensor-parallel rank {rank} holds different tensors than rank 0: {diff[:5]}")
    return {n: merge_tensor(n, [s[n] for s in shards], value_head) for n in names}


def merge_stage_experts(shards: Dict[Tuple[int, int], Dict[str, torch.Tensor]], spec, tp: int, ep: int, etp: int,
                        value_head: bool) -> Dict[str, torch.Tensor]:
    """{(tp_rank, ep_rank): shard} of one stage -> unsplit tensors (local layer names, experts renumbered to
    their global index, `_extra_state` dropped). Dense tensors come from one shard per tp_rank, experts
    from the shards of each ep_rank (every expert-TP slice, or any one shard when etp == 1)."""
    keys = sorted(shards)
    first = shards[keys[0]]
    names = [n for n in first if not is_extra_state(n)]
    for key in keys[1:]:
        other = [n for n in shards[key] if not is_extra_state(n)]
        if set(other) != set(names):
            diff = sorted(set(other) ^ set(names))
            raise ConversionError(
                f"the shard tp_rank={key[0]} ep_rank={key[1]} holds different tensors than tp_rank={keys[0][0]} "
                f"ep_rank={keys[0][1]}: {diff[:5]}")
    by_tp = {}
    for t, e in keys:
        by_tp.setdefault(t, shards[(t, e)])
    missing_tp = [t for t in range(tp) if t not in by_tp]
    if missing_tp:
        raise ConversionError(f"no shard holds tensor-parallel rank(s) {missing_tp} of TP={tp}")
    local = spec.num_experts // ep if spec.is_moe else 0
    out = {}
    for name in names:
        j = expert_index(name)
        if j is None:
            out[name] = merge_tensor(name, [by_tp[t][name] for t in range(tp)], value_head)
            continue
        for e in range(ep):
            if etp == 1:
                holder = next((shards[k] for k in keys if k[1] == e), None)
                if holder is None:
                    raise ConversionError(f"no shard holds expert-parallel rank {e} of EP={ep}")
                tensor = holder[name]
            else:
                missing = [t for t in range(tp) if (t, e) not in shards]
                if missing:
                    raise ConversionError(
                        f"expert-parallel rank {e}: the expert tensor-parallel shard(s) tp_rank={missing} are missing")
                tensor = merge_tensor(name, [shards[(t, e)][name] for t in range(tp)])
            out[with_expert_index(name, e * local + j)] = tensor
    return out


def stage_to_full(stage_sd: Dict[str, torch.Tensor], spec, pp: int, stage: int, value_head: bool) -> Dict[str, torch.Tensor]:
    """Unsplit local tensors of one stage -> global names; the last stage's tied embedding copy is dropped."""
    out = {}
    for name, tensor in stage_sd.items():
        if name == OUTPUT and spec.tie_word_embeddings and not value_head:
            continue  # the copy of the first stage's word embeddings
        out[to_global(name, stage, spec.num_layers, pp)] = tensor
    return out


def split_model(full: Dict[str, torch.Tensor], spec, tp: int, pp: int, value_head: bool,
                with_extra_state: bool = True, ep: int = 1, etp: Optional[int] = None, pairs=None):
    """A full state dict -> {(tp_rank, pp_rank): shard}, or for a mixture of experts split over experts
    (ep > 1) or expert TP != TP {(tp_rank, pp_rank, ep_rank): shard} for the (tp_rank, pp_rank, ep_rank)
    triples `pairs` (default: every combination)."""
    etp = tp if etp is None else etp
    spec.check_parallel(tp, pp, ep, etp)
    three = ep > 1 or etp != tp
    out = {}
    for stage in range(pp):
        stage_sd = stage_state_dict(full, spec, pp, stage, value_head)
        if not spec.is_moe:
            for rank, shard in enumerate(split_stage(stage_sd, tp, value_head, with_extra_state, spec, pp, stage)):
                out[(rank, stage, 0) if three else (rank, stage)] = shard
            continue
        wanted = ([(t, e) for t, p, e in pairs if p == stage] if pairs is not None
                  else [(t, e) for t in range(tp) for e in range(ep)])
        split = split_stage_experts(stage_sd, spec, pp, stage, tp, ep, etp, wanted, value_head, with_extra_state)
        for (t, e), shard in split.items():
            out[(t, stage, e) if three else (t, stage)] = shard
    return out


def merge_model(shards, spec, tp: int, pp: int, value_head: bool, ep: int = 1,
                etp: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """{(tp_rank, pp_rank): shard} or {(tp_rank, pp_rank, ep_rank): shard} -> a full state dict."""
    etp = tp if etp is None else etp
    full = {}
    for stage in range(pp):
        per_stage = {(k[0], k[2] if len(k) > 2 else 0): v for k, v in shards.items() if k[1] == stage}
        if spec.is_moe:
            stage_sd = merge_stage_experts(per_stage, spec, tp, ep, etp, value_head)
        else:
            stage_sd = merge_stage([per_stage[(r, 0)] for r in range(tp)], value_head)
        full.update(stage_to_full(stage_sd, spec, pp, stage, value_head))
    return full
