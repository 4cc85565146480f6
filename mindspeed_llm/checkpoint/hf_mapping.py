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
same tensors (tests/unit/test_moe_convert.py checks both). Both formats are read here; the Hub format is written.

DeepSeek-V3 (model_type deepseek_v3): multi-latent attention replaces q/k/v (names under self_attn. / self_attention.):
q_a_proj -> linear_q_down_proj, q_a_layernorm -> q_layernorm, q_b_proj -> linear_q_up_proj (or q_proj ->
linear_q_proj when q_lora_rank is null), kv_a_proj_with_mqa -> linear_kv_down_proj, kv_a_layernorm ->
kv_layernorm, kv_b_proj -> linear_kv_up_proj, o_proj -> linear_proj, all unchanged (rope dims interleaved as
DeepSeek ships them, rope_interleave=true); `mlp.gate.e_score_correction_bias` -> the router's `expert_bias`
buffer (fp32); `mlp.shared_experts.*` -> `mlp.shared_experts.linear_fc1/fc2`; the first_k_dense_replace layers
keep the dense names. FP8 checkpoints (`*.weight_scale_inv`) are refused; multi-token-prediction layers
(`layers.i` with i >= num_hidden_layers) are skipped.

This module maps full (not tensor-parallel) tensors, layer by layer, and checks a folder's tensors against its
config.json; the Megatron names are `megatron_names.py`, the files `hf_files.py`, and `sharding.py` splits and
merges the tensors. It needs torch, not megatron.
"""

from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional

import torch

from mindspeed_llm.checkpoint.errors import ConversionError
from mindspeed_llm.checkpoint.hf_files import HF_EMBED, HF_FINAL_NORM, HF_LM_HEAD, HF_SCORE, HFWeights, moe_hf_names
from mindspeed_llm.checkpoint.megatron_names import (EMBED, EXPERT_BIAS, FINAL_NORM, MLA_KV_AND_OUT, MLA_Q,
                                                     MLA_Q_LORA, MOE_ROUTER, OUTPUT, SHARED_FC1, SHARED_FC2,
                                                     SHARED_GATE, expert_name, is_moe_layer, mla_attention_names)

# Names accepted by --model-type-hf (MindSpeed-LLM's and config.json's; '-' reads as '_') -> the model_type they
# stand for.
MODEL_TYPE_ALIASES = {
    "llama": "llama", "llama2": "llama", "llama3": "llama", "llama31": "llama", "llama3.1": "llama",
    "llama32": "llama", "llama3.2": "llama",
    "qwen2": "qwen2", "qwen25": "qwen2", "qwen2.5": "qwen2", "qwen2_5": "qwen2",
    "qwen3": "qwen3",
    "mistral": "mistral", "magistral": "mistral",
    "qwen3_moe": "qwen3_moe", "qwen3moe": "qwen3_moe",
    "qwen2_moe": "qwen2_moe", "qwen2moe": "qwen2_moe", "qwen15_moe": "qwen2_moe", "qwen1.5_moe": "qwen2_moe",
    "mixtral": "mixtral",
    "deepseek_v3": "deepseek_v3", "deepseek3": "deepseek_v3", "deepseekv3": "deepseek_v3",
    "deepseek2": "deepseek_v2", "deepseek_v2": "deepseek_v2", "deepseek2_lite": "deepseek_v2",
}

# The weight layout each model_type shares with others. MindSpeed-LLM converts Qwen2 / Qwen2.5 as llama2 plus
# --add-qkv-bias and Mistral as llama, so a --model-type-hf of the same layout only names it; config.json's
# model_type picks the mapping (biases, norms, experts). A name of another layout is a mistake and is refused.
LAYOUTS = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
           "qwen2_moe": "qwen2_moe", "mixtral": "mixtral", "deepseek_v3": "deepseek", "deepseek_v2": "deepseek"}
_LAYOUT_WORDS = {"llama": "dense", "qwen3": "dense, q/k norms", "qwen3_moe": "mixture of experts, q/k norms",
                 "qwen2_moe": "mixture of experts, shared expert", "mixtral": "mixture of experts",
                 "deepseek": "multi-latent attention, mixture of experts"}


def _layout(model_type: str) -> str:
    name = LAYOUTS.get(model_type)
    return f"{name} layout: {_LAYOUT_WORDS[name]}" if name else "another layout"


# Multi-latent attention (DeepSeek-V3): Megatron name (relative to decoder.layers.i.) -> HF name under self_attn.
MLA_NAMES = tuple(zip(MLA_Q_LORA + (MLA_Q,) + MLA_KV_AND_OUT, (
    "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight",
    "q_proj.weight",
    "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight",
)))


def mla_names(spec):
    """(Megatron, HF) attention names of a multi-latent attention layer: q_a/q_b with q_lora_rank, else q_proj."""
    hf = dict(MLA_NAMES)
    return [(mg, hf[mg]) for mg in mla_attention_names(spec)]


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


def supported_model_types() -> str:
    return ", ".join(sorted(MODEL_TYPE_ALIASES))


def _canonical(model_type_hf: str) -> str:
    from mindspeed_llm.models.architecture import UnsupportedModelError

    key = str(model_type_hf).strip().lower().replace("-", "_")
    family = MODEL_TYPE_ALIASES.get(key)
    if family is None:
        raise UnsupportedModelError(
            f"--model-type-hf {model_type_hf!r} is not supported; supported: {supported_model_types()}"
        )
    return family


def model_type_note(model_type_hf: Optional[str], detected: str, where: str = "config.json") -> Optional[str]:
    """None when --model-type-hf is absent or names `detected` (the model's own model_type); a one-line note
    when it names another model_type of the same layout (MindSpeed-LLM's llama2 for a qwen2 model); raises
    ConversionError naming both when it names another layout."""
    if model_type_hf is None:
        return None
    family = _canonical(model_type_hf)
    if detected is None or family == detected:
        return None
    if LAYOUTS.get(family) != LAYOUTS.get(detected):
        raise ConversionError(
            f"--model-type-hf {model_type_hf!r} means model_type {family!r} ({_layout(family)}), but {where} "
            f"says model_type {detected!r} ({_layout(detected)}); drop --model-type-hf to use the config's type"
        )
    return (f"--model-type-hf {model_type_hf}: MindSpeed-LLM's name for the {LAYOUTS[family]} layout, which "
            f"{detected} shares; converting with the {detected} mapping (model_type of {where})")


def resolve_family(model_type_hf: Optional[str], config: dict, where: str = "config.json") -> str:
    """The family (config.json model_type) to convert: the config's; --model-type-hf, when given, must name
    it or a model_type of the same layout (`model_type_note`)."""
    from mindspeed_llm.models.architecture import SUPPORTED_FAMILIES, UnsupportedModelError

    detected = config.get("model_type")
    if model_type_hf is not None:
        family = _canonical(model_type_hf)
        if detected is None:
            detected = family  # a config without model_type: the flag names it
        model_type_note(model_type_hf, detected, where)
    if detected not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"{where}: model_type {detected!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_FAMILIES)} (--model-type-hf accepts {supported_model_types()})"
        )
    return detected

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
