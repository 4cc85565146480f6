"""LoRA adapters on disk: this package's adapter checkpoints, PEFT adapter folders, and merging into a base.

Vocabulary (as in `sharding.py`): a *full* adapter state holds unsplit tensors under global names --
`<module>.lora.A` [r, in] and `<module>.lora.B` [out, r] for every adapted linear `<module>` of the whole model
(`decoder.layers.i.self_attention.linear_qkv`, experts under their global index), plus a value model's trained head
`output_layer.weight`; a *shard* is what one rank's model holds (local layer / expert indices, TP slices). The TP
rules follow the adapted linear's own (`sharding.tp_rule` of `<module>.weight`): for a column-parallel linear
(`column`, `fc1`) B is split exactly as the linear's rows are (fc1: [gate; up] halves separately) and A is
replicated; for a row-parallel one A is split along its columns as the weight is and B replicated.

Adapter checkpoints are training checkpoints of a LoRA run (`<save>/actor`, `<save>/critic`; Megatron-LM's layout):
each shard's `model` holds only the trained tensors, and `lora` holds the config (`models.lora.LoRAConfig`), the
base checkpoint the adapters were trained on (its path and a fingerprint of its weights) and whether it is a value
model.

An adapter checkpoint records its base's fingerprint per shard; `lora_base.py` checks it (and a PEFT folder's base
name) wherever an adapter is applied.

PEFT (`adapter_config.json` + `adapter_model.safetensors`, Hugging Face module names): Megatron fuses q / k / v
into `linear_qkv` and gate / up into `linear_fc1`, each with ONE adapter, so an export writes that adapter's A to
each of `q_proj`, `k_proj`, `v_proj` (resp. `gate_proj`, `up_proj`) and gives each its rows of B: the same function.
Reading a PEFT adapter back, parts with one A (as exported) make a rank-r adapter again; parts with their own A
(PEFT's usual training) are stacked exactly: A = [A_q; A_k; A_v] (rank r_q + r_k + r_v) and B block-diagonal, each
block scaled by its part's scaling over the run's; a part the PEFT adapter lacks gets zero rows of B (they train
once the adapter trains). Routed experts are refused for PEFT (transformers holds them as fused parameters, not
linears); merged exports cover them.

Merging: W <- W + scaling * B A on the full Megatron tensors (any layout of B's rows is the base's own), then the
ordinary conversion writes Hugging Face or Megatron weights.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from mindspeed_llm.checkpoint import hf_files
from mindspeed_llm.checkpoint import hf_mapping as hfm
from mindspeed_llm.checkpoint import megatron_layout as layout
from mindspeed_llm.checkpoint import megatron_names, sharding
from mindspeed_llm.checkpoint.errors import ConversionError

A_SUFFIX, B_SUFFIX = ".lora.A", ".lora.B"
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
PEFT_PREFIX = "base_model.model."
_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")


def module_of(key: str) -> Optional[str]:
    """`<module>` of `<module>.lora.A|B`; None for other keys (the value head)."""
    for suffix in (A_SUFFIX, B_SUFFIX):
        if key.endswith(suffix):
            return key[:-len(suffix)]
    return None


def modules(full: Dict[str, torch.Tensor]) -> List[str]:
    return sorted({m for m in map(module_of, full) if m is not None}, key=_natural)


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def split_rule(module: str) -> str:
    """'column' (B split on its rows, the linear's), 'fc1' ([gate; up] halves) or 'row' (A split on its columns)."""
    rule = sharding.tp_rule(module + ".weight")
    if rule not in ("column", "fc1", "row"):
        raise ConversionError(f"{module} is not a linear LoRA adapts")
    return rule


def split_for_rank(module: str, a: torch.Tensor, b: torch.Tensor, tp: int, rank: int):
    """(A, B) of TP rank `rank` of `tp` from the full ones."""
    if tp == 1:
        return a, b
    name = module + ".weight"
    if split_rule(module) == "row":
        return sharding.split_tensor(name, a, tp)[rank], b.clone()
    return a.clone(), sharding.split_tensor(name, b, tp)[rank]


def merge_ranks(module: str, parts: List[Tuple[torch.Tensor, torch.Tensor]]):
    """Inverse of `split_for_rank` over all TP ranks."""
    if len(parts) == 1:
        return parts[0]
    name = module + ".weight"
    if split_rule(module) == "row":
        return sharding.merge_tensor(name, [a for a, _ in parts]), parts[0][1]
    return parts[0][0], sharding.merge_tensor(name, [b for _, b in parts])


# ------------------------------------------------------------------------------------------- merging
def merge_into(full_base: Dict[str, torch.Tensor], adapter: Dict[str, torch.Tensor], scaling: float,
               strict: bool = True) -> List[str]:
    """W += scaling * B A for every adapter whose base weight `full_base` holds (full tensors, global names; a value
    model's trained head replaces the base's). Computed in fp32, cast back to W's dtype. Returns the merged names.
    With `strict`, an adapter whose weight is absent is an error (a streaming caller passes one stage at a time
    with strict=False)."""
    merged = []
    for module in modules(adapter):
        name = module + ".weight"
        if name not in full_base:
            if strict:
                raise ConversionError(f"the base has no {name} for the adapter of {module}")
            continue
        weight = full_base[name]
        a, b = adapter[module + A_SUFFIX].float(), adapter[module + B_SUFFIX].float()
        if tuple(weight.shape) != (b.shape[0], a.shape[1]):
            raise ConversionError(f"the adapter of {module} is {b.shape[0]} x {a.shape[1]} but the base weight "
                                  f"{name} is {tuple(weight.shape)}: the adapter belongs to another model")
        full_base[name] = (weight.float() + scaling * (b @ a)).to(weight.dtype)
        merged.append(name)
    head = adapter.get(megatron_names.OUTPUT)
    if head is not None and megatron_names.OUTPUT in full_base:
        full_base[megatron_names.OUTPUT] = head.to(full_base[megatron_names.OUTPUT].dtype)
        merged.append(megatron_names.OUTPUT)
    return merged


# ------------------------------------------------------------------------------------------- adapter checkpoints
class Adapter:
    """A full adapter: its config (`models.lora.LoRAConfig`), tensors (global names), the ArchitectureSpec it belongs to
    (None for a PEFT folder, which does not carry one), whether it is a value model's, and where it came from.
    `base`: an adapter checkpoint's recorded base ({"path", "fingerprint"} of its first shard), a PEFT folder's
    {"name": base_model_name_or_path}; an adapter checkpoint also keeps each shard's (`shard_bases`, keyed
    (tp_rank, pp_rank, ep_rank)), its layout (tp, pp, ep, etp) and the precision it trained in."""

    def __init__(self, config, tensors: Dict[str, torch.Tensor], spec=None, value_head: bool = False,
                 source: str = "", base: Optional[dict] = None, shard_bases: Optional[dict] = None,
                 layout: Optional[tuple] = None, params_dtype: Optional[torch.dtype] = None):
        self.config, self.tensors, self.spec, self.value_head = config, tensors, spec, value_head
        self.source, self.base = source, base or {}
        self.shard_bases, self.layout, self.params_dtype = shard_bases or {}, layout, params_dtype

    @property
    def scaling(self) -> float:
        return self.config.scaling


def is_peft_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), PEFT_CONFIG))


def read_adapter(path: str, spec=None, iteration=None) -> Adapter:
    """The adapter at `path`: a PEFT folder (`adapter_config.json`; `spec` maps its names) or an adapter checkpoint
    of this package (a LoRA run's `<save>/actor` or `<save>/critic`)."""
    path = os.fspath(path)
    if is_peft_dir(path):
        if spec is None:
            raise ConversionError(f"{path} is a PEFT adapter: its Megatron names need the base model's spec")
        return read_peft(path, spec)
    return read_checkpoint(path, iteration)


def read_checkpoint(root: str, iteration=None) -> Adapter:
    """Every shard of an adapter checkpoint merged into a full adapter."""
    if not os.path.isdir(root):
        raise ConversionError(f"LoRA adapter {root} does not exist")
    if not os.path.isfile(os.path.join(root, layout.TRACKER_FILE)) and any(
            os.path.isfile(os.path.join(root, r, layout.TRACKER_FILE)) for r in ("actor", "critic")):
        raise ConversionError(f"{root} is a training --save directory; pass its role folder, e.g. "
                              f"{os.path.join(root, 'actor')}")
    try:
        path, iteration = layout.resolve_dir(root, iteration)
        layout.read_layout(path)
    except layout.CheckpointNotFoundError as exc:
        raise ConversionError(f"{root} is neither a PEFT adapter folder ({PEFT_CONFIG}) nor an adapter checkpoint "
                              f"of a LoRA run ({exc})") from None
    return read_checkpoint_dir(path, root)


def read_checkpoint_dir(path: str, root: Optional[str] = None) -> Adapter:
    """The full adapter of one iteration's directory `path` of an adapter checkpoint (a staging one too; `root`:
    how to name it)."""
    from mindspeed_llm.models.lora import LoRAConfig
    from mindspeed_llm.models.architecture import ArchitectureSpec

    root = root or path
    tp, pp, ep, etp = layout.read_layout(path)
    shards = {}
    meta = spec = dtype = None
    bases = {}
    for t, p, e in layout.expected_shards(tp, pp, ep, etp):
        payload = layout.load_file(layout.shard_path(path, t, p, pp, e, ep), weights_only=False)
        if "lora" not in payload:
            raise ConversionError(f"{root} holds full weights, not LoRA adapters (its shards have no 'lora' entry); "
                                  "pass it as --load-dir, or the --save of a LoRA run as --lora-load")
        meta = payload["lora"]
        bases[(t, p, e)] = meta.get("base") or {}
        dtype = getattr(payload.get("args"), "params_dtype", None)
        spec = ArchitectureSpec.from_dict(payload["model_spec"])
        shards[(t, p, e)] = payload["model"]
    local_experts = spec.num_experts // ep if spec.is_moe else 0
    by_module: Dict[str, Dict[int, Tuple[torch.Tensor, torch.Tensor]]] = {}
    full: Dict[str, torch.Tensor] = {}
    for (t, p, e), state in shards.items():
        for key, tensor in state.items():
            name = sharding.to_global(key, p, spec.num_layers, pp)
            match = _EXPERT.match(name)
            if match and local_experts:
                name = f"{match.group(1)}{e * local_experts + int(match.group(2))}{match.group(3)}"
            module = module_of(name)
            if module is None:  # the value head (replicated)
                full[name] = tensor
                continue
            slot = by_module.setdefault(module, {}).setdefault(t, [None, None])
            slot[0 if key.endswith(A_SUFFIX) else 1] = tensor
    for module, ranks in by_module.items():
        tps = sorted(ranks)
        parts = [tuple(ranks[t]) for t in tps]
        a, b = merge_ranks(module, parts) if len(parts) > 1 else parts[0]
        full[module + A_SUFFIX], full[module + B_SUFFIX] = a, b
    first = bases[min(bases)]
    return Adapter(LoRAConfig.from_dict(meta["config"]), full, spec, bool(meta.get("value_head")), root, first,
                   shard_bases={k: v for k, v in bases.items() if v.get("fingerprint")}, layout=(tp, pp, ep, etp),
                   params_dtype=dtype if isinstance(dtype, torch.dtype) else None)


# ------------------------------------------------------------------------------------------- PEFT names
def _hf_parts(module: str, spec) -> Tuple[str, List[str], str]:
    """(HF module prefix, its HF linears, how the Megatron adapter's B splits over them: 'qkv', 'halves', 'one')."""
    match = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", module)
    if not match:
        raise ConversionError(f"{module}: not a decoder linear")
    p, rel = f"model.layers.{match.group(1)}.", match.group(2)
    if rel == "self_attention.linear_qkv":
        return p + "self_attn.", ["q_proj", "k_proj", "v_proj"], "qkv"
    if rel == "self_attention.linear_proj":
        return p + "self_attn.", ["o_proj"], "one"
    for mg, hf in hfm.MLA_NAMES:
        if rel + ".weight" == mg:
            return p + "self_attn.", [hf[:-len(".weight")]], "one"
    if rel == "mlp.linear_fc1":
        return p + "mlp.", ["gate_proj", "up_proj"], "halves"
    if rel == "mlp.linear_fc2":
        return p + "mlp.", ["down_proj"], "one"
    if rel.startswith("mlp.shared_experts."):
        prefix = p + hfm.shared_hf_prefix(spec)
        return (prefix, ["gate_proj", "up_proj"], "halves") if rel.endswith("linear_fc1") else (prefix, ["down_proj"],
                                                                                                "one")
    if rel.startswith("mlp.experts."):
        raise ConversionError(f"{module}: transformers holds routed experts as fused parameters, not linear modules, "
                              "so PEFT's LoRA cannot carry their adapters; export merged weights instead (drop "
                              "--save-lora-to-hf), or train without the experts' linears")
    raise ConversionError(f"{module}: no Hugging Face linear for it")


def _split_b(b: torch.Tensor, how: str, spec) -> List[torch.Tensor]:
    if how == "qkv":
        return list(hfm.split_qkv(b, spec))
    if how == "halves":
        return list(torch.chunk(b, 2, dim=0))
    return [b]


def to_peft(adapter: Adapter, spec, base_name: Optional[str] = None) -> Tuple[Dict[str, torch.Tensor], dict]:
    """The PEFT state dict (`base_model.model.<hf module>.lora_A.weight`, ...) and `adapter_config.json` of a full
    adapter."""
    config = adapter.config
    state: Dict[str, torch.Tensor] = {}
    leaves, rank_pattern, alpha_pattern = [], {}, {}
    for module in modules(adapter.tensors):
        prefix, parts, how = _hf_parts(module, spec)
        a, b = adapter.tensors[module + A_SUFFIX], adapter.tensors[module + B_SUFFIX]
        for part, b_part in zip(parts, _split_b(b, how, spec)):
            name = prefix + part
            state[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a.contiguous().clone()
            state[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b_part.contiguous().clone()
            if part not in leaves:
                leaves.append(part)
            if a.shape[0] != config.r:  # PEFT's scaling is alpha / r per module: keep ours
                rank_pattern[name] = int(a.shape[0])
                alpha_pattern[name] = config.scaling * a.shape[0]
    if adapter.value_head:
        state[PEFT_PREFIX + hf_files.HF_SCORE] = adapter.tensors[megatron_names.OUTPUT].contiguous().clone()
    peft_config = {
        "peft_type": "LORA", "task_type": "SEQ_CLS" if adapter.value_head else "CAUSAL_LM",
        "base_model_name_or_path": base_name, "r": config.r, "lora_alpha": config.alpha,
        "lora_dropout": config.dropout, "target_modules": leaves, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": ["score"] if adapter.value_head else None,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
    }
    return state, peft_config


def write_peft(adapter: Adapter, spec, out_dir: str, base_name: Optional[str] = None) -> List[str]:
    """`adapter_config.json` + `adapter_model.safetensors` in `out_dir` (the weights first, the config last)."""
    from safetensors.torch import save_file

    from mindspeed_llm.files import write_atomically

    state, peft_config = to_peft(adapter, spec, base_name)
    os.makedirs(out_dir, exist_ok=True)
    stale = os.path.join(out_dir, PEFT_CONFIG)
    if os.path.exists(stale):
        os.remove(stale)  # the config goes back last: a failed export never looks loadable
    write_atomically(os.path.join(out_dir, PEFT_WEIGHTS[0]), lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    hf_files.write_json_atomic(os.path.join(out_dir, PEFT_CONFIG), peft_config)
    return [PEFT_WEIGHTS[0], PEFT_CONFIG]


def _peft_pattern(pattern: dict, name: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name ending in it (regex)."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def read_peft(path: str, spec):
    """A PEFT LoRA folder as a full adapter for a model of `spec` (see the module docstring for the stacking)."""
    from mindspeed_llm.models.lora import LoRAConfig

    config = hf_files.read_json(os.path.join(path, PEFT_CONFIG))
    where = os.path.join(path, PEFT_CONFIG)
    if config.get("peft_type") != "LORA":
        raise ConversionError(f"{where}: peft_type {config.get('peft_type')!r}; only LoRA adapters are read")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False)):
        if bool(config.get(key)) != ok:
            raise ConversionError(f"{where}: {key}: {config.get(key)} is not supported (plain LoRA only)")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise ConversionError(f"{where}: bias {config.get('bias')!r}: adapters with biases are not supported")
    saved = [m for m in (config.get("modules_to_save") or []) if m not in ("score", "classifier")]
    if saved:
        raise ConversionError(f"{where}: modules_to_save {saved}: only LoRA adapters (and a value model's score) are "
                              "read")
    tensors = _read_peft_weights(path)
    r, alpha, rslora = int(config["r"]), float(config["lora_alpha"]), bool(config.get("use_rslora"))
    ours = alpha / (r ** 0.5 if rslora else r)  # our scaling, alpha / r
    per_part: Dict[str, Tuple[torch.Tensor, torch.Tensor, float]] = {}
    score = None
    for key in tensors:
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        if name in (hf_files.HF_SCORE, "score.modules_to_save.weight"):
            score = tensors[key]
            continue
        match = re.match(r"^(.+)\.lora_([AB])(?:\.default)?\.weight$", name)
        if not match:
            raise ConversionError(f"{path}: tensor {key} is not a LoRA A or B matrix")
        module = match.group(1)
        if module in per_part:
            continue
        a = tensors.get(f"{PEFT_PREFIX}{module}.lora_A.weight")
        b = tensors.get(f"{PEFT_PREFIX}{module}.lora_B.weight")
        if a is None or b is None:
            raise ConversionError(f"{path}: {module} has only one of lora_A / lora_B")
        rank = int(_peft_pattern(config.get("rank_pattern"), module, r))
        part_alpha = float(_peft_pattern(config.get("alpha_pattern"), module, alpha))
        per_part[module] = (a.float(), b.float(), part_alpha / (rank ** 0.5 if rslora else rank))
    full: Dict[str, torch.Tensor] = {}
    ranks: Dict[str, int] = {}
    used = set()
    targets = set()
    for index in range(spec.num_layers):
        for module in _megatron_linears(spec, index):
            prefix, parts, how = _hf_parts(module, spec)
            present = [prefix + p for p in parts if prefix + p in per_part]
            if not present:
                continue
            used.update(present)
            targets.add(module.rsplit(".", 1)[-1])
            a, b = _fused(module, [prefix + p for p in parts], per_part, ours, how, spec)
            full[module + A_SUFFIX], full[module + B_SUFFIX] = a, b
            if a.shape[0] != r:
                ranks[module] = int(a.shape[0])
    unused = sorted(set(per_part) - used)
    if unused:
        raise ConversionError(f"{path}: adapters of {', '.join(unused[:4])} have no Megatron linear in this "
                              f"{spec.family} model (embeddings, heads and routed experts are not adapted here)")
    value_head = score is not None
    if value_head:
        full[megatron_names.OUTPUT] = score.float()
    lora_config = LoRAConfig(r=r, alpha=ours * r, dropout=float(config.get("lora_dropout") or 0.0),
                             target_modules=tuple(t for t in _TARGET_ORDER if t in targets), ranks=ranks)
    return Adapter(lora_config, full, None, value_head, path, {"name": config.get("base_model_name_or_path")})


_TARGET_ORDER = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_proj", "linear_q_down_proj",
                 "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")


def _megatron_linears(spec, index: int) -> List[str]:
    p = f"decoder.layers.{index}."
    out = [p + lin for lin in sharding._extra_state_linears(spec, index, 0) if "local_experts" not in lin]
    return out


def _fused(module, names, per_part, scaling, how, spec):
    """One Megatron adapter (A, B) from its HF parts (`names`, in B's order); see the module docstring."""
    present = [n for n in names if n in per_part]
    first = per_part[present[0]]
    shared = len(present) == len(names) and all(
        torch.equal(per_part[n][0], first[0]) for n in present)
    if shared:
        a = first[0]
        blocks = [per_part[n][1] * (per_part[n][2] / scaling) for n in names]
    else:
        a = torch.cat([per_part[n][0] for n in present], dim=0)
        offsets, total = {}, 0
        for n in present:
            offsets[n], total = total, total + per_part[n][0].shape[0]
        rows = _part_rows(module, names, spec)
        blocks = []
        for n, count in zip(names, rows):
            block = torch.zeros(count, total)
            if n in per_part:
                r_n = per_part[n][0].shape[0]
                block[:, offsets[n]:offsets[n] + r_n] = per_part[n][1] * (per_part[n][2] / scaling)
            blocks.append(block)
    if how == "qkv":
        b = hfm.fuse_qkv(*blocks, spec)
    elif how == "halves":
        b = torch.cat(blocks, dim=0)
    else:
        b = blocks[0]
    return a.contiguous(), b.contiguous()


def _part_rows(module, names, spec) -> List[int]:
    """Output rows of each HF part of a fused Megatron linear."""
    if len(names) == 3:
        groups, q_rows, kv_rows = hfm._qkv_sizes(spec)
        return [groups * q_rows, groups * kv_rows, groups * kv_rows]
    if len(names) == 2:
        width = spec.moe_shared_expert_intermediate_size if ".shared_experts." in module else spec.ffn_hidden_size
        return [width, width]
    raise ConversionError(f"{module}: a single HF linear needs no fusing")


def _read_peft_weights(path: str) -> Dict[str, torch.Tensor]:
    for name in PEFT_WEIGHTS:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(file)
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 (a truncated or foreign file: name it)
            raise ConversionError(f"{file} cannot be read ({' '.join(str(err).split())[:200]})") from None
    raise ConversionError(f"{path} has {PEFT_CONFIG} but no {' or '.join(PEFT_WEIGHTS)}")


# ------------------------------------------------------------------------------------------- conversions
def adapter_for_base(path: str, spec, value_head: bool, iteration=None) -> Adapter:
    """The adapter of `convert_ckpt.py --lora-load PATH`, checked against the base it is merged into (or exported
    beside): the same model (its ArchitectureSpec, when the adapter carries one), a value model's adapter for a value
    model's base."""
    from mindspeed_llm.checkpoint.convert import spec_differences

    adapter = read_adapter(path, spec, iteration)
    if adapter.spec is not None:
        diffs = spec_differences(adapter.spec, spec)
        if diffs:
            listed = "; ".join(f"{k}: adapter {a!r} vs base {b!r}" for k, (a, b) in diffs.items())
            raise ConversionError(f"--lora-load {path}: its adapters belong to another model ({listed})")
    if adapter.value_head != bool(value_head):
        kind = "a value model's (a critic's)" if adapter.value_head else "a causal LM's"
        raise ConversionError(f"--lora-load {path} is {kind} adapter but the base is "
                              f"{'a value model' if value_head else 'a causal LM'}; "
                              f"{'add' if adapter.value_head else 'drop'} --orm or pass the matching base")
    return adapter


class Merger:
    """Merges an adapter into the full tensors of a conversion as they stream by (one pipeline stage at a time);
    `finish()` checks that every adapter found its weight, and with `base_check` (a `lora_base.BaseCheck`) that the weights it
    saw before the merge are the base the adapter was trained on (`base`: how to name them; `allow`:
    --allow-base-mismatch, a warning instead)."""

    def __init__(self, adapter: Adapter, base_check=None, base: str = "",
                 allow: bool = False):
        self.adapter = adapter
        self.done: set = set()
        self.base_check, self.base, self.allow = base_check, base, allow

    def __call__(self, full: Dict[str, torch.Tensor]) -> None:
        if self.base_check is not None:
            self.base_check.add(full)
        self.done.update(merge_into(full, self.adapter.tensors, self.adapter.scaling, strict=False))

    def check_base(self) -> None:
        problem = self.base_check.problem(self.base) if self.base_check is not None else None
        if problem is None:
            return
        if not self.allow:
            raise ConversionError(problem)
        import logging

        logging.getLogger("mindspeed_llm.checkpoint").warning("--allow-base-mismatch: %s", problem.split("; pass")[0])

    def finish(self) -> None:
        self.check_base()
        wanted = {m + ".weight" for m in modules(self.adapter.tensors)}
        if self.adapter.value_head:
            wanted.add(megatron_names.OUTPUT)
        missing = sorted(wanted - self.done, key=_natural)
        if missing:
            raise ConversionError(f"--lora-load {self.adapter.source}: the base has no {', '.join(missing[:4])}: "
                                  "the adapter belongs to another model")
