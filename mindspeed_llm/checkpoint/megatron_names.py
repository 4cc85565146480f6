"""Megatron-core's tensor names of the local-spec `GPTModel` (dense, mixtures of experts, multi-latent attention):
the schema `sharding.py` splits and merges by, and `hf_mapping.py` maps to Hugging Face's. The names of a layer
are relative to `decoder.layers.i.` (`layer_key` adds it); experts are `mlp.experts.local_experts.j.`
(`expert_name`). No torch, no megatron.
"""

from __future__ import annotations

import re
from typing import List, Optional

EMBED = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"
LAYER_PREFIX = "decoder.layers."

# Megatron names (relative to decoder.layers.i.) of a mixture-of-experts MLP.
MOE_ROUTER = "mlp.router.weight"
SHARED_FC1 = "mlp.shared_experts.linear_fc1.weight"
SHARED_FC2 = "mlp.shared_experts.linear_fc2.weight"
SHARED_GATE = "mlp.shared_experts.gate_weight"
EXPERT_BIAS = "mlp.router.expert_bias"  # DeepSeek-V3's e_score_correction_bias (fp32 buffer)

# Multi-latent attention (DeepSeek-V3): q through a low-rank down projection, norm and up projection when
# q_lora_rank is set, else one q projection; then the kv ones and the output projection.
MLA_Q_LORA = ("self_attention.linear_q_down_proj.weight", "self_attention.q_layernorm.weight",
              "self_attention.linear_q_up_proj.weight")
MLA_Q = "self_attention.linear_q_proj.weight"
MLA_KV_AND_OUT = ("self_attention.linear_kv_down_proj.weight", "self_attention.kv_layernorm.weight",
                  "self_attention.linear_kv_up_proj.weight", "self_attention.linear_proj.weight")

EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|_extra_state)$")


def expert_name(j: int, linear: str, what: str = "weight") -> str:
    """`mlp.experts.local_experts.j.linear_fc1.weight` (linear: linear_fc1 | linear_fc2)."""
    return f"mlp.experts.local_experts.{j}.{linear}.{what}"


def mla_attention_names(spec) -> List[str]:
    """The attention tensors of a multi-latent attention layer, in GPTModel order (q_lora_rank decides q's)."""
    return (list(MLA_Q_LORA) if spec.q_lora_rank is not None else [MLA_Q]) + list(MLA_KV_AND_OUT)


def layer_key(index: int, rel: str) -> str:
    return f"{LAYER_PREFIX}{index}.{rel}"


def is_moe_layer(spec, index: int) -> bool:
    """Whether global layer `index` has a mixture-of-experts MLP."""
    return bool(spec.is_moe and spec.moe_layers()[index])


def _attention_names(spec) -> List[str]:
    if spec.is_mla:
        return ["input_layernorm.weight"] + mla_attention_names(spec) + ["pre_mlp_layernorm.weight"]
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
