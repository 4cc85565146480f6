"""Hugging Face <-> Megatron-core tensor names and layouts (Llama, Qwen2/2.5, Qwen3, Mistral families and the
mixtures of experts Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3).

All four families share the Llama layout on the Hugging Face side; they differ only in optional tensors
(Qwen2: q/k/v biases; Qwen3: per-head q/k RMSNorms). The Megatron side is the local-spec `GPTModel`:

| Hugging Face                                         | Megatron-core (global layer index)              |
|------------------------------------------------------|-------------------------------------------------|
| model.embed_tokens.weight                            | embedding.word_embeddings.weight                |
| model.layers.i.input_layernorm.weight                | decoder.layers.i.input_layernorm.weight         |
| model.layers.i.self_attn.{q,k,v}_proj.weight (+bias) | decoder.layers.i.self_attention.linear_qkv.*    |
| model.layers.i.self_attn.{q,k}_norm.weight           | decoder.layers.i.self_attention.{q,k}_layernorm |
| model.layers.i.self_attn.o_proj.weight               | decoder.layers.i.self_attention.linear_proj     |
| model.layers.i.post_attention_layernorm.weight       | decoder.layers.i.pre_mlp_layernorm.weight       |
| model.layers.i.mlp.{gate,up}_proj.weight             | decoder.layers.i.mlp.linear_fc1.weight          |
| model.layers.i.mlp.down_proj.weight                  | decoder.layers.i.mlp.linear_fc2.weight          |
| model.norm.weight                                    | decoder.final_layernorm.weight                  |
| lm_head.weight (absent when tied)                    | output_layer.weight (absent when tied, PP=1)    |
| score.weight [1, hidden] (`--orm`)                   | output_layer.weight of the ValueHead (fp32)     |

Fused layouts: `linear_qkv` rows are grouped per key/value head g as [q rows of the heads of group g |
k rows of g | v rows of g] (the bias likewise); `linear_fc1` rows are [gate ; up].

Mixture-of-experts layers (every layer of a MoE model except Qwen-MoE's `mlp_only_layers`, which keep the
dense names above) replace the MLP rows; M = `mlp.` (Qwen-MoE) or `block_sparse_moe.` (Mixtral), expert
projections gate/up/down = gate_proj/up_proj/down_proj (Qwen-MoE) or w1/w3/w2 (Mixtral):

| Hugging Face (Hub / save_pretrained format)          | Megatron-core (global expert index j)           |
|------------------------------------------------------|-------------------------------------------------|
| model.layers.i.M.gate.weight [E, hidden] (router)    | decoder.layers.i.mlp.router.weight              |
| model.layers.i.M.experts.j.{gate,up}.weight          | ...mlp.experts.local_experts.j.linear_fc1.weight|
| model.layers.i.M.experts.j.down.weight               | ...mlp.experts.local_experts.j.linear_fc2.weight|
| model.layers.i.mlp.shared_expert.{gate,up}_proj      | ...mlp.shared_experts.linear_fc1.weight         |
| model.layers.i.mlp.shared_expert.down_proj           | ...mlp.shared_experts.linear_fc2.weight         |
| model.layers.i.mlp.shared_expert_gate.weight [1, h]  | ...mlp.shared_experts.gate_weight               |

transformers 5.x holds experts fused in memory (`mlp.experts.gate_up_proj` [E, 2F, hidden] = [gate ; up] per
expert, `mlp.experts.down_proj` [E, hidden, F], Mixtral's router as `mlp.gate.weight`) but its
`save_pretrained` (5.24) writes the per-expert Hub names above, and `from_pretrained` reads them back into the
same tensors (tests/test_moe_convert.py checks both). Both formats are read here; the Hub format is written.

DeepSeek-V3 (model_type deepseek_v3): multi-latent attention replaces q/k/v (names under self_attn. / self_attention.):
q_a_proj -> linear_q_down_proj, q_a_layernorm -> q_layernorm, q_b_proj -> linear_q_up_proj (or q_proj ->
linear_q_proj when q_lora_rank is null), kv_a_proj_with_mqa -> linear_kv_down_proj, kv_a_layernorm ->
kv_layernorm, kv_b_proj -> linear_kv_up_proj, o_proj -> linear_proj, all unchanged (rope dims interleaved as
DeepSeek ships them, rope_interleave=true); `mlp.gate.e_score_correction_bias` -> the router's `expert_bias`
buffer (fp32); `mlp.shared_experts.*` -> `mlp.shared_experts.linear_fc1/fc2`; the first_k_dense_replace layers
keep the dense names. FP8 checkpoints (`*.weight_scale_inv`) are refused; multi-token-prediction layers
(`layers.i` with i >= num_hidden_layers) are skipped.

This module holds full (not tensor-parallel) tensors only; `sharding.py` splits and merges them.
It needs torch and safetensors, not megatron.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, Dict, Iterable, List, Optional

import torch

from mindspeed_llm.checkpoint.megatron_layout import write_atomically

# Names accepted by --model-type-hf -> the config.json model_type they stand for.
MODEL_TYPE_ALIASES = {
    "llama": "llama", "llama2": "llama", "llama3": "llama", "llama31": "llama", "llama3.1": "llama",
    "llama32": "llama", "llama3.2": "llama",
    "qwen2": "qwen2", "qwen25": "qwen2", "qwen2.5": "qwen2", "qwen2_5": "qwen2",
    "qwen3": "qwen3",
    "mistral": "mistral",
    "qwen3_moe": "qwen3_moe", "qwen3moe": "qwen3_moe",
    "qwen2_moe": "qwen2_moe", "qwen2moe": "qwen2_moe", "qwen15_moe": "qwen2_moe", "qwen1.5_moe": "qwen2_moe",
    "mixtral": "mixtral",
    "deepseek_v3": "deepseek_v3", "deepseek3": "deepseek_v3", "deepseekv3": "deepseek_v3",
}

EMBED = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"
LAYER_PREFIX = "decoder.layers."

HF_EMBED = "embed_tokens.weight"
HF_FINAL_NORM = "norm.weight"
HF_LM_HEAD = "lm_head.weight"
HF_SCORE = "score.weight"

# Megatron names (relative to decoder.layers.i.) of a mixture-of-experts MLP.
MOE_ROUTER = "mlp.router.weight"
SHARED_FC1 = "mlp.shared_experts.linear_fc1.weight"
SHARED_FC2 = "mlp.shared_experts.linear_fc2.weight"
SHARED_GATE = "mlp.shared_experts.gate_weight"
EXPERT_BIAS = "mlp.router.expert_bias"  # DeepSeek-V3's e_score_correction_bias (fp32 buffer)
# Multi-latent attention (DeepSeek-V3): Megatron name (relative to decoder.layers.i.) -> HF name under self_attn.
MLA_NAMES = (
    ("self_attention.linear_q_down_proj.weight", "q_a_proj.weight"),
    ("self_attention.q_layernorm.weight", "q_a_layernorm.weight"),
    ("self_attention.linear_q_up_proj.weight", "q_b_proj.weight"),
    ("self_attention.linear_q_proj.weight", "q_proj.weight"),
    ("self_attention.linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight"),
    ("self_attention.kv_layernorm.weight", "kv_a_layernorm.weight"),
    ("self_attention.linear_kv_up_proj.weight", "kv_b_proj.weight"),
    ("self_attention.linear_proj.weight", "o_proj.weight"),
)


def mla_names(spec):
    """(Megatron, HF) attention names of a multi-latent attention layer: q_a/q_b with q_lora_rank, else q_proj."""
    skip = ("self_attention.linear_q_proj.weight",) if spec.q_lora_rank is not None else (
        "self_attention.linear_q_down_proj.weight", "self_attention.q_layernorm.weight",
        "self_attention.linear_q_up_proj.weight")
    return [(mg, hf) for mg, hf in MLA_NAMES if mg not in skip]


def shared_hf_prefix(spec) -> str:
    """HF prefix of the shared expert: Qwen2-MoE's `mlp.shared_expert.`, DeepSeek-V3's `mlp.shared_experts.`."""
    return "mlp.shared_experts." if spec.family == "deepseek_v3" else "mlp.shared_expert."


def fp8_scale_names(names) -> List[str]:
    return sorted(n for n in names if n.endswith("weight_scale_inv"))


def mtp_names(names, spec) -> List[str]:
    """HF tensors of DeepSeek-V3's multi-token-prediction layers (`layers.i.` with i >= num_hidden_layers):
    not part of the decoder, so not converted."""
    out = []
    for name in names:
        match = re.match(r"^layers\.(\d+)\.", name)
        if match and int(match.group(1)) >= spec.num_layers:
            out.append(name)
    return out
EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|_extra_state)$")


def expert_name(j: int, linear: str, what: str = "weight") -> str:
    """`mlp.experts.local_experts.j.linear_fc1.weight` (linear: linear_fc1 | linear_fc2)."""
    return f"mlp.experts.local_experts.{j}.{linear}.{what}"

# HF files that carry the tokenizer (and generation defaults): copied next to converted weights.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)

# Tensors older exports carry that hold no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class ConversionError(ValueError):
    """A checkpoint cannot be converted as asked; the message names the file, tensor or flag."""


def supported_model_types() -> str:
    return ", ".join(sorted(MODEL_TYPE_ALIASES))


def resolve_family(model_type_hf: Optional[str], config: dict, where: str = "config.json") -> str:
    """The family (config.json model_type) to convert, from --model-type-hf and/or the config."""
    from mindspeed_llm.models.spec import SUPPORTED_FAMILIES, UnsupportedModelError

    detected = config.get("model_type")
    if model_type_hf is None:
        if detected not in SUPPORTED_FAMILIES:
            raise UnsupportedModelError(
                f"{where}: model_type {detected!r} is not supported; supported model types: "
                f"{', '.join(SUPPORTED_FAMILIES)} (--model-type-hf accepts {supported_model_types()})"
            )
        return detected
    family = MODEL_TYPE_ALIASES.get(str(model_type_hf).strip().lower())
    if family is None:
        raise UnsupportedModelError(
            f"--model-type-hf {model_type_hf!r} is not supported; supported: {supported_model_types()}"
        )
    if detected is not None and detected != family:
        raise ConversionError(
            f"--model-type-hf {model_type_hf!r} means model_type {family!r}, but {where} says "
            f"model_type {detected!r}; drop --model-type-hf to use the config's type"
        )
    return family


# ------------------------------------------------------------------------------------------- readers

class HFWeights:
    """Lazy reader of a Hugging Face model folder's tensors.

    Handles `model.safetensors`, sharded `model.safetensors.index.json`, `pytorch_model.bin` and sharded
    `pytorch_model.bin.index.json`. Key names are returned without the decoder prefix ("model." for
    *ForCausalLM / *ForSequenceClassification exports, "" for bare *Model exports); `lm_head.weight`
    and `score.weight` keep theirs.
    """

    def __init__(self, path: str):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"Hugging Face model directory {self.path} does not exist")
        self._files: Dict[str, str] = {}  # raw key -> file
        self._handles: Dict[str, object] = {}
        self._bins: Dict[str, Dict[str, torch.Tensor]] = {}
        # Per-expert names read out of transformers' fused expert tensors: name -> (fused name, expert, part).
        self._views: Dict[str, tuple] = {}
        self._fused: Dict[str, str] = {}  # fused name -> raw key
        self._cached: tuple = (None, None)  # (fused name, tensor): one fused tensor is read once for its experts
        self._discover()
        raw = list(self._files)
        self.prefix = "model." if any(k.startswith("model.") for k in raw) else ""
        self._by_name = {}
        for key in raw:
            if key.endswith(_IGNORED_SUFFIXES):
                continue
            if self.prefix and key.startswith(self.prefix):
                self._by_name[key[len(self.prefix):]] = key
            else:
                self._by_name[key] = key

    def _discover(self) -> None:
        candidates = [
            ("model.safetensors.index.json", True), ("model.safetensors", False),
            ("pytorch_model.bin.index.json", True), ("pytorch_model.bin", False),
        ]
        for name, is_index in candidates:
            full = os.path.join(self.path, name)
            if not os.path.isfile(full):
                continue
            if is_index:
                weight_map = _read_json(full).get("weight_map") or {}
                if not weight_map:
                    raise ConversionError(f"{full} has no weight_map")
                for key, shard in weight_map.items():
                    shard_path = os.path.join(self.path, shard)
                    if not os.path.isfile(shard_path):
                        raise FileNotFoundError(f"{full} lists {shard} (for {key}) but {shard_path} is missing")
                    self._files[key] = shard_path
            else:
                for key in self._keys_of(full):
                    self._files[key] = full
            return
        raise FileNotFoundError(
            f"no Hugging Face weights in {self.path}: expected model.safetensors, model.safetensors.index.json, "
            f"pytorch_model.bin or pytorch_model.bin.index.json"
        )

    def _keys_of(self, file: str) -> List[str]:
        if file.endswith(".safetensors"):
            return list(self._handle(file).keys())
        return list(self._bin(file).keys())

    def _handle(self, file: str):
        if file not in self._handles:
            from safetensors import safe_open

            try:
                self._handles[file] = safe_open(file, framework="pt", device="cpu")
            except Exception as err:  # SafetensorError: truncated or not a safetensors file
                raise _unreadable(file, err) from None
        return self._handles[file]

    def _bin(self, file: str) -> Dict[str, torch.Tensor]:
        if file not in self._bins:
            try:
                try:
                    self._bins[file] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # legacy (non-zip) torch.save format cannot be memory-mapped
                    self._bins[file] = torch.load(file, map_location="cpu", weights_only=True)
            except (RuntimeError, EOFError, OSError, ValueError) as err:
                raise _unreadable(file, err) from None
        return self._bins[file]

    def expose_fused_experts(self, spec) -> None:
        """Let transformers' fused expert tensors (`layers.i.mlp.experts.gate_up_proj` [E, 2F, hidden] and
        `down_proj` [E, hidden, F]) read as the per-expert Hub names of `spec`'s family; Mixtral's fused
        router `layers.i.mlp.gate.weight` reads as `block_sparse_moe.gate.weight`. No-op for a dense model
        or the Hub format."""
        if not spec.is_moe:
            return
        moe, (gate, up, down) = moe_hf_names(spec)
        fused = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
        for name in list(self._by_name):
            match = fused.match(name)
            if not match:
                continue
            layer, kind = match.group(1), match.group(2)
            shape = self._raw_shape(name)
            rows = spec.num_experts
            if len(shape) != 3 or shape[0] != rows or (kind == "gate_up_proj" and shape[1] % 2):
                raise ConversionError(
                    f"fused expert tensor {self.prefix}{name} in {self.path} has shape {tuple(shape)}; "
                    f"{'[num_experts, 2 x expert width, hidden]' if kind == 'gate_up_proj' else '[num_experts, hidden, expert width]'} "
                    f"with num_experts={rows} was expected: use the config.json these weights were saved with")
            base = f"layers.{layer}.{moe}experts."
            for j in range(rows):
                if kind == "gate_up_proj":
                    self._views[f"{base}{j}.{gate}.weight"] = (name, j, 0)
                    self._views[f"{base}{j}.{up}.weight"] = (name, j, 1)
                else:
                    self._views[f"{base}{j}.{down}.weight"] = (name, j, None)
            self._fused[name] = self._by_name.pop(name)  # read only through the per-expert views
            if moe != "mlp.":
                router = f"layers.{layer}.mlp.gate.weight"
                if router in self._by_name:
                    self._by_name[f"layers.{layer}.{moe}gate.weight"] = self._by_name.pop(router)

    def _view(self, name: str) -> torch.Tensor:
        source, j, part = self._views[name]
        if self._cached[0] != source:
            self._cached = (source, self._raw_get(source))
        tensor = self._cached[1][j]
        if part is not None:
            tensor = torch.chunk(tensor, 2, dim=0)[part]
        return tensor.clone()

    def names(self) -> List[str]:
        return list(self._by_name) + list(self._views)

    def has(self, name: str) -> bool:
        return name in self._by_name or name in self._views

    def get(self, name: str) -> torch.Tensor:
        if name in self._views:
            return self._view(name)
        return self._raw_get(name)

    def _raw_get(self, name: str) -> torch.Tensor:
        if name not in self._by_name and name not in self._fused:
            raise ConversionError(f"Hugging Face checkpoint {self.path} has no tensor {self.prefix}{name}")
        key = self._by_name.get(name) or self._fused[name]
        file = self._files[key]
        if file.endswith(".safetensors"):
            try:
                return self._handle(file).get_tensor(key)
            except ConversionError:
                raise
            except Exception as err:
                raise _unreadable(file, err, key) from None
        return self._bin(file)[key]

    def shape(self, name: str) -> tuple:
        """The shape of tensor `name`, without reading its data (safetensors)."""
        if name in self._views:
            source, _, part = self._views[name]
            fused = self._raw_shape(source)
            return (fused[1] // 2 if part is not None else fused[1], fused[2])
        return self._raw_shape(name)

    def _raw_shape(self, name: str) -> tuple:
        key = self._by_name.get(name) or self._fused[name]
        file = self._files[key]
        if file.endswith(".safetensors"):
            try:
                return tuple(self._handle(file).get_slice(key).get_shape())
            except ConversionError:
                raise
            except Exception as err:
                raise _unreadable(file, err, key) from None
        return tuple(self._bin(file)[key].shape)

    def dtype(self) -> torch.dtype:
        """The dtype of the weights (that of the embedding)."""
        return self.get(HF_EMBED).dtype


def _unreadable(file: str, err: Exception, key: Optional[str] = None) -> "ConversionError":
    what = f" (reading {key})" if key else ""
    detail = " ".join(str(err).split())[:200]
    return ConversionError(
        f"{file} cannot be read{what}: it is truncated or not a valid weights file ({detail}); download or copy "
        f"it again (compare its size with the source)")


def _read_json(file: str) -> dict:
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise ConversionError(f"{file} is not valid JSON ({err}); download or copy it again") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def read_hf_config(path: str) -> dict:
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.isdir(os.fspath(path)):
        raise FileNotFoundError(f"Hugging Face model directory {path} does not exist")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no config.json in {path}: pass a Hugging Face model directory as --load-dir")
    return _read_json(file)


# ------------------------------------------------------------------------------------------- fused layouts

def _qkv_sizes(spec):
    groups = spec.num_query_groups
    per_group = spec.num_attention_heads // groups
    return groups, per_group * spec.kv_channels, spec.kv_channels


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec) -> torch.Tensor:
    """[heads*d (+ ...)], [groups*d], [groups*d] -> Megatron's per-group interleaved [q_g | k_g | v_g]."""
    groups, q_rows, kv_rows = _qkv_sizes(spec)
    tail = q.shape[1:]
    parts = (q.reshape(groups, q_rows, *tail), k.reshape(groups, kv_rows, *tail), v.reshape(groups, kv_rows, *tail))
    return torch.cat(parts, dim=1).reshape(groups * (q_rows + 2 * kv_rows), *tail)


def split_qkv(qkv: torch.Tensor, spec):
    """Inverse of `fuse_qkv` for the full (or one TP rank's, with `spec` sized to it) tensor."""
    groups, q_rows, kv_rows = _qkv_sizes(spec)
    tail = qkv.shape[1:]
    grouped = qkv.reshape(groups, q_rows + 2 * kv_rows, *tail)
    q, k, v = torch.split(grouped, [q_rows, kv_rows, kv_rows], dim=1)
    return (q.reshape(groups * q_rows, *tail), k.reshape(groups * kv_rows, *tail),
            v.reshape(groups * kv_rows, *tail))


# ------------------------------------------------------------------------------------------- per layer

def layer_key(index: int, rel: str) -> str:
    return f"{LAYER_PREFIX}{index}.{rel}"


def is_moe_layer(spec, index: int) -> bool:
    """Whether global layer `index` has a mixture-of-experts MLP."""
    return bool(spec.is_moe and spec.moe_layers()[index])


def moe_hf_names(spec):
    """(prefix of the MoE block, (gate, up, down) expert projection names) of `spec`'s family."""
    if spec.family == "mixtral":
        return "block_sparse_moe.", ("w1", "w3", "w2")
    return "mlp.", ("gate_proj", "up_proj", "down_proj")


def _attention_names(spec) -> List[str]:
    if spec.is_mla:
        return ["input_layernorm.weight"] + [mg for mg, _ in mla_names(spec)] + ["pre_mlp_layernorm.weight"]
    names = ["input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight"]
    if spec.add_qkv_bias:
        names.append("self_attention.linear_qkv.bias")
    if spec.qk_layernorm:
        names += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    return names + ["pre_mlp_layernorm.weight"]


def mg_layer_names(spec, index: int = 0, num_experts: Optional[int] = None) -> List[str]:
    """Names (relative to decoder.layers.i.) of global layer `index`'s tensors, in GPTModel order.

    A MoE layer lists experts 0..num_experts-1 (default: all of them, global indices; a shard passes its
    number of local experts)."""
    names = _attention_names(spec)
    if not is_moe_layer(spec, index):
        return names + ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    names.append(MOE_ROUTER)
    if spec.moe_router_enable_expert_bias:
        names.append(EXPERT_BIAS)
    for j in range(spec.num_experts if num_experts is None else num_experts):
        names += [expert_name(j, "linear_fc1"), expert_name(j, "linear_fc2")]
    if spec.moe_shared_expert_intermediate_size:
        if spec.moe_shared_expert_gate:
            names.append(SHARED_GATE)
        names += [SHARED_FC1, SHARED_FC2]
    return names


def hf_layer_names(spec, index: int) -> List[str]:
    """HF names (without the decoder prefix) of layer `index`, in the Hub (per-expert) format."""
    p = f"layers.{index}."
    names = [p + "input_layernorm.weight"]
    if spec.is_mla:
        names += [p + "self_attn." + hf for _, hf in mla_names(spec)]
    else:
        names += [p + f"self_attn.{x}_proj.weight" for x in ("q", "k", "v", "o")]
    if spec.add_qkv_bias:
        names += [p + f"self_attn.{x}_proj.bias" for x in ("q", "k", "v")]
    if spec.qk_layernorm:
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    names += [p + "post_attention_layernorm.weight"]
    if not is_moe_layer(spec, index):
        return names + [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    moe, projs = moe_hf_names(spec)
    names.append(p + moe + "gate.weight")
    if spec.moe_router_enable_expert_bias:
        names.append(p + moe + "gate.e_score_correction_bias")
    for j in range(spec.num_experts):
        names += [p + f"{moe}experts.{j}.{x}.weight" for x in projs]
    if spec.moe_shared_expert_intermediate_size:
        names += [p + f"{shared_hf_prefix(spec)}{x}_proj.weight" for x in ("gate", "up", "down")]
        if spec.moe_shared_expert_gate:
            names.append(p + "mlp.shared_expert_gate.weight")
    return names


def hf_layer_to_mg(get: Callable[[str], torch.Tensor], spec, index: int) -> Dict[str, torch.Tensor]:
    """Layer `index` from HF tensors (get(name) without decoder prefix) -> {relative Megatron name: tensor}
    (MoE experts under their global index)."""
    p = f"layers.{index}."
    attn = p + "self_attn."
    if spec.is_mla:
        out = {"input_layernorm.weight": get(p + "input_layernorm.weight")}
        out.update({mg: get(attn + hf) for mg, hf in mla_names(spec)})
    else:
        out = {
            "input_layernorm.weight": get(p + "input_layernorm.weight"),
            "self_attention.linear_proj.weight": get(attn + "o_proj.weight"),
            "self_attention.linear_qkv.weight": fuse_qkv(
                get(attn + "q_proj.weight"), get(attn + "k_proj.weight"), get(attn + "v_proj.weight"), spec),
        }
    if spec.add_qkv_bias:
        out["self_attention.linear_qkv.bias"] = fuse_qkv(
            get(attn + "q_proj.bias"), get(attn + "k_proj.bias"), get(attn + "v_proj.bias"), spec)
    if spec.qk_layernorm:
        out["self_attention.q_layernorm.weight"] = get(attn + "q_norm.weight")
        out["self_attention.k_layernorm.weight"] = get(attn + "k_norm.weight")
    out["pre_mlp_layernorm.weight"] = get(p + "post_attention_layernorm.weight")
    if not is_moe_layer(spec, index):
        out["mlp.linear_fc1.weight"] = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")],
                                                 dim=0)
        out["mlp.linear_fc2.weight"] = get(p + "mlp.down_proj.weight")
        return out
    moe, (gate, up, down) = moe_hf_names(spec)
    out[MOE_ROUTER] = get(p + moe + "gate.weight")
    if spec.moe_router_enable_expert_bias:
        out[EXPERT_BIAS] = get(p + moe + "gate.e_score_correction_bias")
    for j in range(spec.num_experts):
        e = f"{p}{moe}experts.{j}."
        out[expert_name(j, "linear_fc1")] = torch.cat([get(e + gate + ".weight"), get(e + up + ".weight")], dim=0)
        out[expert_name(j, "linear_fc2")] = get(e + down + ".weight")
    if spec.moe_shared_expert_intermediate_size:
        s = p + shared_hf_prefix(spec)
        if spec.moe_shared_expert_gate:
            out[SHARED_GATE] = get(p + "mlp.shared_expert_gate.weight")
        out[SHARED_FC1] = torch.cat([get(s + "gate_proj.weight"), get(s + "up_proj.weight")], dim=0)
        out[SHARED_FC2] = get(s + "down_proj.weight")
    return out


def mg_layer_to_hf(layer: Dict[str, torch.Tensor], spec, index: int, prefix: str = "model.") -> Dict[str, torch.Tensor]:
    """{relative Megatron name: full tensor} of layer `index` (experts under global indices) -> {HF name (with
    prefix): tensor}, experts in the per-expert Hub format."""
    p = f"{prefix}layers.{index}."
    attn = p + "self_attn."
    if spec.is_mla:
        out = {p + "input_layernorm.weight": layer["input_layernorm.weight"]}
        out.update({attn + hf: layer[mg] for mg, hf in mla_names(spec)})
    else:
        q, k, v = split_qkv(layer["self_attention.linear_qkv.weight"], spec)
        out = {
            p + "input_layernorm.weight": layer["input_layernorm.weight"],
            attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v,
            attn + "o_proj.weight": layer["self_attention.linear_proj.weight"],
        }
    if spec.add_qkv_bias:
        qb, kb, vb = split_qkv(layer["self_attention.linear_qkv.bias"], spec)
        out.update({attn + "q_proj.bias": qb, attn + "k_proj.bias": kb, attn + "v_proj.bias": vb})
    if spec.qk_layernorm:
        out[attn + "q_norm.weight"] = layer["self_attention.q_layernorm.weight"]
        out[attn + "k_norm.weight"] = layer["self_attention.k_layernorm.weight"]
    out[p + "post_attention_layernorm.weight"] = layer["pre_mlp_layernorm.weight"]
    if not is_moe_layer(spec, index):
        gate, up = torch.chunk(layer["mlp.linear_fc1.weight"], 2, dim=0)
        out[p + "mlp.gate_proj.weight"] = gate
        out[p + "mlp.up_proj.weight"] = up
        out[p + "mlp.down_proj.weight"] = layer["mlp.linear_fc2.weight"]
        return out
    moe, (gate_name, up_name, down_name) = moe_hf_names(spec)
    out[p + moe + "gate.weight"] = layer[MOE_ROUTER]
    if spec.moe_router_enable_expert_bias:
        out[p + moe + "gate.e_score_correction_bias"] = layer[EXPERT_BIAS]
    for j in range(spec.num_experts):
        e = f"{p}{moe}experts.{j}."
        gate, up = torch.chunk(layer[expert_name(j, "linear_fc1")], 2, dim=0)
        out[e + gate_name + ".weight"] = gate
        out[e + up_name + ".weight"] = up
        out[e + down_name + ".weight"] = layer[expert_name(j, "linear_fc2")]
    if spec.moe_shared_expert_intermediate_size:
        s = p + shared_hf_prefix(spec)
        gate, up = torch.chunk(layer[SHARED_FC1], 2, dim=0)
        out[s + "gate_proj.weight"] = gate
        out[s + "up_proj.weight"] = up
        out[s + "down_proj.weight"] = layer[SHARED_FC2]
        if spec.moe_shared_expert_gate:
            out[p + "mlp.shared_expert_gate.weight"] = layer[SHARED_GATE]
    return out


# ------------------------------------------------------------------------------------------- whole model

def mtp_layer_count(config: dict) -> int:
    """DeepSeek-V3's multi-token-prediction layers declared by config.json (transformers 5: num_mtp_layers)."""
    return int(config.get("num_nextn_predict_layers") or config.get("num_mtp_layers") or 0)


def check_hf_names(weights: HFWeights, spec, value_head: bool, mtp_layers: int = 0) -> None:
    """Every tensor the conversion needs is present and no tensor would be silently dropped (except the
    `mtp_layers` multi-token-prediction layers after the decoder's, which are not converted)."""
    expected = {HF_EMBED, HF_FINAL_NORM}
    for i in range(spec.num_layers):
        expected.update(hf_layer_names(spec, i))
    optional = set()
    if value_head:
        if not weights.has(HF_SCORE):
            hint = " (it has lm_head.weight: a causal LM, not a reward/critic model)" if weights.has(HF_LM_HEAD) else ""
            raise ConversionError(
                f"--orm: the Hugging Face checkpoint {weights.path} has no score.weight{hint}; --orm needs a "
                f"*ForSequenceClassification (reward / critic) checkpoint with score.weight [1, hidden]"
            )
        expected.add(HF_SCORE)
        optional.add(HF_LM_HEAD)
    elif spec.tie_word_embeddings:
        optional.add(HF_LM_HEAD)  # transformers may or may not save the tied copy
    else:
        if not weights.has(HF_LM_HEAD) and weights.has(HF_SCORE):
            raise ConversionError(
                f"the Hugging Face checkpoint {weights.path} has score.weight and no lm_head.weight: it is a "
                f"reward / critic (*ForSequenceClassification) model; pass --orm to convert its value head"
            )
        expected.add(HF_LM_HEAD)
    present = set(weights.names())
    scales = fp8_scale_names(present)
    if scales:
        raise ConversionError(
            f"the Hugging Face checkpoint {weights.path} is FP8-quantised ({weights.prefix}{scales[0]} and "
            f"{len(scales) - 1} more weight_scale_inv tensors); dequantise it to bf16 first (e.g. DeepSeek-V3's "
            f"inference/fp8_cast_bf16.py), drop quantization_config from its config.json, and convert that")
    mtp = mtp_names(present, spec)
    if mtp:
        if not mtp_layers:
            raise ConversionError(
                f"the Hugging Face checkpoint {weights.path} has tensors past num_hidden_layers={spec.num_layers} "
                f"({weights.prefix}{mtp[0]}) but its config.json declares no num_nextn_predict_layers; use the "
                f"config.json these weights were saved with")
        present -= set(mtp)  # multi-token-prediction layers: not converted (convert_hf_to_mg notes it)
    missing = sorted(expected - present)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ConversionError(
            f"the Hugging Face checkpoint {weights.path} lacks tensors needed for a {spec.family} model with "
            f"{spec.num_layers} layers: {', '.join(weights.prefix + m for m in missing[:5])}{more}"
        )
    unexpected = sorted(present - expected - optional)
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise ConversionError(
            f"the Hugging Face checkpoint {weights.path} has tensors a {spec.family} model of this config does not "
            f"use (the conversion would drop them): {', '.join(unexpected[:5])}{more}"
        )
    score = weights.get(HF_SCORE) if value_head else None
    if score is not None and tuple(score.shape) != (1, spec.hidden_size):
        raise ConversionError(
            f"--orm: score.weight in {weights.path} has shape {tuple(score.shape)}; a value head needs "
            f"[1, {spec.hidden_size}] (num_labels=1)"
        )


def hf_expected_shapes(spec, value_head: bool) -> Dict[str, tuple]:
    """{HF name (without the decoder prefix): (shape, the config.json fields it follows)} of every
    tensor a model of `spec` has (lm_head.weight included even when tied: it is checked if present)."""
    h, f, d = spec.hidden_size, spec.ffn_hidden_size, spec.kv_channels
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    qf = f"num_attention_heads={spec.num_attention_heads}, head_dim={d}"
    kvf = f"num_key_value_heads={spec.num_query_groups}, head_dim={d}"
    hf, ff = f"hidden_size={h}", f"intermediate_size={f}"
    vocab = ((spec.vocab_size, h), f"vocab_size={spec.vocab_size}, {hf}")
    out = {HF_EMBED: vocab, HF_FINAL_NORM: ((h,), hf)}
    if value_head:
        out[HF_SCORE] = ((1, h), f"num_labels=1, {hf}")
    else:
        out[HF_LM_HEAD] = vocab
    for i in range(spec.num_layers):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        out[p + "input_layernorm.weight"] = ((h,), hf)
        out[p + "post_attention_layernorm.weight"] = ((h,), hf)
        if spec.is_mla:
            out.update(_mla_shapes(spec, a))
        else:
            _attention_shapes(spec, out, a, h, q, kv, qf, kvf, hf, d)
        if not is_moe_layer(spec, i):
            out[p + "mlp.gate_proj.weight"] = ((f, h), f"{ff}, {hf}")
            out[p + "mlp.up_proj.weight"] = ((f, h), f"{ff}, {hf}")
            out[p + "mlp.down_proj.weight"] = ((h, f), f"{hf}, {ff}")
            continue
        _moe_shapes(spec, out, p, h, hf)
    return out


def _mla_shapes(spec, a: str) -> Dict[str, tuple]:
    h, n = spec.hidden_size, spec.num_attention_heads
    nope, rope, v, kv, ql = (spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim, spec.kv_lora_rank,
                             spec.q_lora_rank)
    hf, nf = f"hidden_size={h}", f"num_attention_heads={n}"
    qk = f"{nf}, qk_nope_head_dim={nope}, qk_rope_head_dim={rope}"
    out = {
        a + "kv_a_proj_with_mqa.weight": ((kv + rope, h), f"kv_lora_rank={kv}, qk_rope_head_dim={rope}, {hf}"),
        a + "kv_a_layernorm.weight": ((kv,), f"kv_lora_rank={kv}"),
        a + "kv_b_proj.weight": ((n * (nope + v), kv), f"{nf}, qk_nope_head_dim={nope}, v_head_dim={v}, "
                                                       f"kv_lora_rank={kv}"),
        a + "o_proj.weight": ((h, n * v), f"{hf}, {nf}, v_head_dim={v}"),
    }
    if ql is None:
        out[a + "q_proj.weight"] = ((n * (nope + rope), h), f"{qk}, {hf}")
    else:
        out[a + "q_a_proj.weight"] = ((ql, h), f"q_lora_rank={ql}, {hf}")
        out[a + "q_a_layernorm.weight"] = ((ql,), f"q_lora_rank={ql}")
        out[a + "q_b_proj.weight"] = ((n * (nope + rope), ql), f"{qk}, q_lora_rank={ql}")
    return out


def _attention_shapes(spec, out, a, h, q, kv, qf, kvf, hf, d) -> None:
    out[a + "q_proj.weight"] = ((q, h), f"{qf}, {hf}")
    out[a + "k_proj.weight"] = ((kv, h), f"{kvf}, {hf}")
    out[a + "v_proj.weight"] = ((kv, h), f"{kvf}, {hf}")
    out[a + "o_proj.weight"] = ((h, q), f"{hf}, {qf}")
    if spec.add_qkv_bias:
        out[a + "q_proj.bias"] = ((q,), qf)
        out[a + "k_proj.bias"] = ((kv,), kvf)
        out[a + "v_proj.bias"] = ((kv,), kvf)
    if spec.qk_layernorm:
        out[a + "q_norm.weight"] = ((d,), f"head_dim={d}")
        out[a + "k_norm.weight"] = ((d,), f"head_dim={d}")


def _moe_shapes(spec, out, p, h, hf) -> None:
    moe, (gate, up, down) = moe_hf_names(spec)
    n, m = spec.num_experts, spec.moe_ffn_hidden_size
    nf = f"{_EXPERT_COUNT_KEY.get(spec.family, 'num_experts')}={n}"
    mf = f"{'intermediate_size' if spec.family == 'mixtral' else 'moe_intermediate_size'}={m}"
    out[p + moe + "gate.weight"] = ((n, h), f"{nf}, {hf}")
    if spec.moe_router_enable_expert_bias:
        out[p + moe + "gate.e_score_correction_bias"] = ((n,), nf)
    for j in range(n):
        e = f"{p}{moe}experts.{j}."
        out[e + gate + ".weight"] = ((m, h), f"{mf}, {hf}")
        out[e + up + ".weight"] = ((m, h), f"{mf}, {hf}")
        out[e + down + ".weight"] = ((h, m), f"{hf}, {mf}")
    shared = spec.moe_shared_expert_intermediate_size
    if shared:
        sf = (f"n_shared_experts x moe_intermediate_size={shared}" if spec.family == "deepseek_v3"
              else f"shared_expert_intermediate_size={shared}")
        s = p + shared_hf_prefix(spec)
        out[s + "gate_proj.weight"] = ((shared, h), f"{sf}, {hf}")
        out[s + "up_proj.weight"] = ((shared, h), f"{sf}, {hf}")
        out[s + "down_proj.weight"] = ((h, shared), f"{hf}, {sf}")
        if spec.moe_shared_expert_gate:
            out[p + "mlp.shared_expert_gate.weight"] = ((1, h), hf)


_EXPERT_COUNT_KEY = {"mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts"}


def check_hf_shapes(weights: HFWeights, spec, value_head: bool, config_file: str = "config.json") -> None:
    """Every tensor has the shape config.json implies; the vocabulary first, named with both numbers
    (a config whose vocab_size disagrees with the embedding would make a checkpoint that mis-reads ids)."""
    if weights.has(HF_EMBED):
        rows = weights.shape(HF_EMBED)[0]
        if rows != spec.vocab_size:
            raise ConversionError(
                f"{config_file} says vocab_size={spec.vocab_size} but {weights.prefix}{HF_EMBED} in {weights.path} "
                f"has {rows} rows; set vocab_size to {rows} in config.json, or use the config.json that belongs to "
                f"these weights")
    for name, (shape, fields) in hf_expected_shapes(spec, value_head).items():
        if not weights.has(name):
            continue
        actual = weights.shape(name)
        if tuple(actual) != tuple(shape):
            full = name if name in (HF_LM_HEAD, HF_SCORE) else weights.prefix + name
            raise ConversionError(
                f"tensor {full} in {weights.path} has shape {tuple(actual)} but {config_file} ({fields}) implies "
                f"{tuple(shape)}; the config does not describe these weights: use the config.json they were "
                f"saved with")


def hf_nonlayer_to_mg(weights: HFWeights, spec, value_head: bool, first: bool, last: bool) -> Dict[str, torch.Tensor]:
    """Embedding (first stage), final norm and output / value head (last stage), full tensors."""
    out = {}
    if first:
        out[EMBED] = weights.get(HF_EMBED)
    if last:
        out[FINAL_NORM] = weights.get(HF_FINAL_NORM)
        if value_head:
            out[OUTPUT] = weights.get(HF_SCORE).to(torch.float32)
        elif not spec.tie_word_embeddings:
            out[OUTPUT] = weights.get(HF_LM_HEAD)
    return out


def mg_nonlayer_to_hf(full: Dict[str, torch.Tensor], spec, value_head: bool, prefix: str = "model.") -> Dict[str, torch.Tensor]:
    out = {}
    if EMBED in full:
        out[prefix + HF_EMBED] = full[EMBED]
    if FINAL_NORM in full:
        out[prefix + HF_FINAL_NORM] = full[FINAL_NORM]
    if OUTPUT in full:
        if value_head:
            out[HF_SCORE] = full[OUTPUT]
        elif not spec.tie_word_embeddings:
            out[HF_LM_HEAD] = full[OUTPUT]
    return out


# ------------------------------------------------------------------------------------------- writers

def _independent(tensors: Iterable[torch.Tensor]):
    """Contiguous tensors that share no storage (safetensors refuses shared or partial storages)."""
    seen = set()
    for t in tensors:
        t = t.detach().contiguous()
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        yield t


def save_hf_weights(state: Dict[str, torch.Tensor], out_dir: str, max_shard_bytes: int = 5 * 1024 ** 3) -> List[str]:
    """Write `state` as model.safetensors (or shards + model.safetensors.index.json) atomically per file.

    Each file is written under a temporary name and renamed into place; the index (when sharded) last.
    Returns the file names written.
    """
    from safetensors.torch import save_file

    names = list(state)
    tensors = dict(zip(names, _independent(state[n] for n in names)))
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    written = []
    if len(shards) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, shard in zip(files, shards):
        write_atomically(os.path.join(out_dir, file), lambda tmp: save_file(shard, tmp, metadata={"format": "pt"}))
        written.append(file)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {name: file for file, shard in zip(files, shards) for name in shard},
        }
        write_json_atomic(os.path.join(out_dir, "model.safetensors.index.json"), index)
        written.append("model.safetensors.index.json")
    return written


_WEIGHT_FILE = re.compile(
    r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
    r"pytorch_model(-\d{5}-of-\d{5})?\.bin|pytorch_model\.bin\.index\.json)$"
)


def remove_hf_weights(out_dir: str) -> List[str]:
    """Delete weight files a previous export left in `out_dir` (a different sharding would shadow ours)."""
    removed = []
    if not os.path.isdir(out_dir):
        return removed
    for name in os.listdir(out_dir):
        if _WEIGHT_FILE.match(name):
            os.remove(os.path.join(out_dir, name))
            removed.append(name)
    return removed


def write_json_atomic(path: str, data) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def copy_tokenizer_files(src: str, dst: str) -> List[str]:
    """Copy the tokenizer (and generation_config) files found in `src` to `dst`; returns their names."""
    import shutil

    copied = []
    if not src or not os.path.isdir(src):
        return copied
    for name in sorted(os.listdir(src)):
        if name in TOKENIZER_FILES or name.endswith(".tiktoken"):
            tmp = os.path.join(dst, f".{name}.tmp")
            shutil.copyfile(os.path.join(src, name), tmp)
            os.replace(tmp, os.path.join(dst, name))
            copied.append(name)
    return copied
