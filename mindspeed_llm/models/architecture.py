"""`ArchitectureSpec`: the architecture of a decoder-only model, independent of any framework.

It is read from a Hugging Face `config.json` (Llama, Qwen2/2.5, Qwen3, Mistral families and the
mixture-of-experts families Qwen3-MoE, Qwen2-MoE, Mixtral, and DeepSeek-V3 with multi-latent attention) or from the
Megatron model flags, stored inside every Megatron checkpoint we write (so a stage can check that the
actor, reference, critic and reward agree on vocabulary), and written back as a clean `config.json`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, List, Optional

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral") + MOE_FAMILIES

_HF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "LlamaForSequenceClassification"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3ForSequenceClassification"),
    "mistral": ("MistralForCausalLM", "MistralForSequenceClassification"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeForSequenceClassification"),
    "mixtral": ("MixtralForCausalLM", "MixtralForSequenceClassification"),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3ForSequenceClassification"),
}
# Families whose attention has q/k/v biases, and those with per-head q/k RMSNorms.
_QKV_BIAS = ("qwen2", "qwen2_moe")
_QK_NORM = ("qwen3", "qwen3_moe")


class UnsupportedModelError(ValueError):
    pass


@dataclass
class ArchitectureSpec:
    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    max_position_embeddings: int = 4096
    norm_epsilon: float = 1e-6
    rotary_base: float = 10000.0
    # Llama-3.1/3.2 style frequency scaling (Megatron implements low=1, high=4, original 8192 only).
    rope_scaling_factor: Optional[float] = None
    tie_word_embeddings: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    # Mixture of experts (None: a dense model). Megatron-core's router semantics:
    #   pre_softmax=False: top-k of the logits, softmax over the k (= HF softmax, top-k, renormalise);
    #   pre_softmax=True:  softmax over all experts, then top-k, no renormalisation (HF norm_topk_prob=False).
    num_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    moe_router_topk: int = 2
    moe_router_pre_softmax: bool = False
    moe_router_score_function: str = "softmax"
    moe_aux_loss_coeff: float = 0.0
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_gate: bool = False
    # One entry per layer, 1 = MoE MLP, 0 = dense MLP of ffn_hidden_size (None: every layer is MoE).
    moe_layer_pattern: Optional[List[int]] = None
    # DeepSeek-V3 routing: sigmoid scores + expert bias (e_score_correction_bias) choose the experts,
    # group-limited top-k (n_group groups, topk_group kept), weights renormalised then scaled.
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_enable_expert_bias: bool = False
    # Multi-latent attention (DeepSeek-V3; kv_lora_rank None: ordinary attention). q_lora_rank None: q_proj.
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    # YaRN RoPE (rope_type yarn; factor None: plain RoPE on the rope part).
    yarn_factor: Optional[float] = None
    yarn_original_max_position_embeddings: Optional[int] = None
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    def moe_layers(self) -> List[int]:
        """1/0 per layer: which layers have a mixture-of-experts MLP."""
        if not self.is_moe:
            return [0] * self.num_layers
        return list(self.moe_layer_pattern) if self.moe_layer_pattern is not None else [1] * self.num_layers

    # ------------------------------------------------------------------ Hugging Face config.json
    @classmethod
    def from_hf_config(cls, config: Any) -> "ArchitectureSpec":
        """`config` is a path to a model folder or config.json, a dict, or a transformers config."""
        if isinstance(config, (str, os.PathLike)):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no Hugging Face config.json at {path}")
            with open(path) as f:
                config = json.load(f)
        elif not isinstance(config, dict):
            config = config.to_dict()
        family = config.get("model_type")
        if family not in SUPPORTED_FAMILIES:
            raise UnsupportedModelError(
                f"model_type {family!r} is not supported; supported families: {', '.join(SUPPORTED_FAMILIES)}"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {config.get('hidden_act')!r}: only silu (SwiGLU) is supported")
        heads = config["num_attention_heads"]
        if family == "deepseek_v3":
            return cls._from_deepseek_v3(config)
        rope_factor = None
        scaling = config.get("rope_scaling") or (config.get("rope_parameters") or None)
        rotary_base = config.get("rope_theta")
        if isinstance(scaling, dict):
            rotary_base = scaling.get("rope_theta", rotary_base)
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type == "llama3":
                expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
                for key, value in expected.items():
                    if float(scaling.get(key, value)) != value:
                        raise UnsupportedModelError(
                            f"rope_scaling {key}={scaling.get(key)}: megatron-core implements llama3 scaling only "
                            f"with {key}={value}"
                        )
                rope_factor = float(scaling["factor"])
            elif rope_type not in ("default", None):
                raise UnsupportedModelError(f"rope_scaling type {rope_type!r} is not supported (default, llama3)")
        if config.get("attention_bias") and family not in _QKV_BIAS:
            raise UnsupportedModelError(
                f"attention_bias=true is only supported for the {' and '.join(_QKV_BIAS)} families")
        if family in ("qwen2_moe",) and not config.get("qkv_bias", True):
            raise UnsupportedModelError("qwen2_moe with qkv_bias=false is not supported")
        if config.get("use_sliding_window") or (family == "mixtral" and config.get("sliding_window")):
            raise UnsupportedModelError(
                f"sliding-window attention (sliding_window={config.get('sliding_window')}) is not supported")
        eos = config.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            family=family,
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            ffn_hidden_size=config["intermediate_size"],
            num_attention_heads=heads,
            num_query_groups=config.get("num_key_value_heads") or heads,
            kv_channels=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            norm_epsilon=config.get("rms_norm_eps", 1e-6),
            rotary_base=float(rotary_base if rotary_base is not None else 10000.0),
            rope_scaling_factor=rope_factor,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            add_qkv_bias=family in _QKV_BIAS,
            qk_layernorm=family in _QK_NORM,
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=eos,
            **_moe_fields_from_hf(family, config),
        )

    @classmethod
    def _from_deepseek_v3(cls, config: Dict[str, Any]) -> "ArchitectureSpec":
        """DeepSeek-V3 (MLA, YaRN, sigmoid group-limited routing with expert bias, shared experts)."""
        def bad(key, why):
            return UnsupportedModelError(f"deepseek_v3 config.json: {key}={config.get(key)!r} {why}")

        expected = {"hidden_act": "silu", "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                    "attention_bias": False, "rope_interleave": True, "moe_layer_freq": 1, "norm_topk_prob": True}
        why = {"hidden_act": "is not supported (only silu / SwiGLU)",
               "scoring_func": "is not supported (megatron's router here: sigmoid with expert bias)",
               "topk_method": "is not supported (noaux_tc: expert choice by score + e_score_correction_bias)",
               "attention_bias": "is not supported (MLA projections without bias)",
               "rope_interleave": "is not supported (megatron's MLA reads the rope dims interleaved, as "
                                  "DeepSeek's own checkpoints hold them)",
               "moe_layer_freq": "is not supported (every layer from first_k_dense_replace on is MoE)",
               "norm_topk_prob": "is not supported (megatron's sigmoid router always renormalises its top-k)"}
        for key, value in expected.items():
            if key in config and config[key] is not None and config[key] != value:
                raise bad(key, why[key])
        layers = config["num_hidden_layers"]
        experts, topk = config["n_routed_experts"], config["num_experts_per_tok"]
        groups, group_topk = config.get("n_group") or 1, config.get("topk_group") or 1
        if experts % groups:
            raise bad("n_group", f"does not divide n_routed_experts={experts}")
        if groups > 1 and group_topk < groups and topk // group_topk != 2:
            # both sum the top-2 scores per group only when num_experts_per_tok // topk_group == 2
            raise bad("topk_group", f"with num_experts_per_tok={topk}: megatron ranks groups by their top "
                      f"{topk}//topk_group scores, transformers by their top 2; they agree only when "
                      f"num_experts_per_tok // topk_group == 2")
        limited = groups > 1 and group_topk < groups
        dense = int(config.get("first_k_dense_replace") or 0)
        scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        if rope_type not in ("yarn", "default", None):
            raise UnsupportedModelError(f"deepseek_v3 config.json: rope type {rope_type!r} is not supported "
                                        "(yarn, default)")
        rotary_base = scaling.get("rope_theta", config.get("rope_theta", 10000.0))
        yarn = {}
        if rope_type == "yarn":
            yarn = dict(
                yarn_factor=float(scaling["factor"]),
                yarn_original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                yarn_beta_fast=float(scaling.get("beta_fast") or 32.0),
                yarn_beta_slow=float(scaling.get("beta_slow") or 1.0),
                yarn_mscale=float(scaling.get("mscale") or 1.0),
                yarn_mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
            )
        eos = config.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        shared = config.get("n_shared_experts") or 0
        heads = config["num_attention_heads"]
        return cls(
            family="deepseek_v3",
            num_layers=layers,
            hidden_size=config["hidden_size"],
            ffn_hidden_size=config["intermediate_size"],
            num_attention_heads=heads,
            num_query_groups=heads,
            kv_channels=config["v_head_dim"],  # megatron's attention output width per head
            vocab_size=config["vocab_size"],
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            norm_epsilon=config.get("rms_norm_eps", 1e-6),
            rotary_base=float(rotary_base),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=eos,
            num_experts=experts,
            moe_ffn_hidden_size=config["moe_intermediate_size"],
            moe_router_topk=topk,
            moe_router_pre_softmax=False,
            moe_router_score_function="sigmoid",
            moe_aux_loss_coeff=float(config.get("aux_loss_alpha") or 0.0),
            moe_shared_expert_intermediate_size=shared * config["moe_intermediate_size"] or None,
            moe_layer_pattern=[0] * dense + [1] * (layers - dense) if dense else None,
            moe_router_num_groups=groups if limited else None,
            moe_router_group_topk=group_topk if limited else None,
            moe_router_topk_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
            moe_router_enable_expert_bias=True,
            q_lora_rank=config.get("q_lora_rank"),
            kv_lora_rank=config["kv_lora_rank"],
            qk_nope_head_dim=config["qk_nope_head_dim"],
            qk_rope_head_dim=config["qk_rope_head_dim"],
            v_head_dim=config["v_head_dim"],
            **yarn,
        )

    def _deepseek_v3_to_hf(self) -> Dict[str, Any]:
        dense = self.moe_layers().index(1) if 1 in self.moe_layers() else self.num_layers
        shared = self.moe_shared_expert_intermediate_size or 0
        out = {
            "num_key_value_heads": self.num_attention_heads,
            "n_routed_experts": self.num_experts,
            "num_experts_per_tok": self.moe_router_topk,
            "moe_intermediate_size": self.moe_ffn_hidden_size,
            "n_shared_experts": shared // self.moe_ffn_hidden_size,
            "n_group": self.moe_router_num_groups or 1,
            "topk_group": self.moe_router_group_topk or 1,
            "routed_scaling_factor": self.moe_router_topk_scaling_factor or 1.0,
            "norm_topk_prob": True,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "first_k_dense_replace": dense,
            "moe_layer_freq": 1,
            "aux_loss_alpha": self.moe_aux_loss_coeff,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "head_dim": self.qk_rope_head_dim,
            "rope_interleave": True,
            "attention_bias": False,
            "num_nextn_predict_layers": 0,  # MTP layers are not converted
        }
        if self.yarn_factor is not None:
            out["rope_scaling"] = {
                "rope_type": "yarn", "factor": self.yarn_factor,
                "original_max_position_embeddings": self.yarn_original_max_position_embeddings,
                "beta_fast": self.yarn_beta_fast, "beta_slow": self.yarn_beta_slow,
                "mscale": self.yarn_mscale, "mscale_all_dim": self.yarn_mscale_all_dim,
            }
        return out

    def to_hf_config(self, torch_dtype: str = "float32", value_head: bool = False) -> Dict[str, Any]:
        """A clean config.json for `transformers` (no quantization_config, with `architectures`)."""
        causal, seq_cls = _HF_ARCHITECTURES[self.family]
        config: Dict[str, Any] = {
            "architectures": [seq_cls if value_head else causal],
            "model_type": self.family,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups,
            "head_dim": self.kv_channels,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.norm_epsilon,
            "rope_theta": self.rotary_base,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": torch_dtype,
            "attention_dropout": 0.0,
            "use_cache": True,
        }
        if self.rope_scaling_factor is not None:
            config["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": self.rope_scaling_factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        if self.family == "llama":
            config.update(attention_bias=False, mlp_bias=False)
        if self.family == "deepseek_v3":
            config.update(self._deepseek_v3_to_hf())
        elif self.is_moe:
            config.update(_moe_fields_to_hf(self))
        if self.bos_token_id is not None:
            config["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            config["eos_token_id"] = self.eos_token_id
        if value_head:
            config["num_labels"] = 1
            config["pad_token_id"] = self.eos_token_id if self.eos_token_id is not None else 0
        return config

    # ------------------------------------------------------------------ serialisation inside checkpoints
    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "ArchitectureSpec":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def check_parallel(self, tp: int, pp: int, ep: int = 1, etp: Optional[int] = None) -> None:
        """Errors that name the flag when the model cannot be split TP x PP (x EP, expert TP) ways."""
        etp = tp if etp is None else etp
        if self.is_moe:
            if self.num_experts % ep:
                raise ValueError(
                    f"--expert-model-parallel-size {ep} (times TP with --moe-tp-extend-ep) does not divide "
                    f"num_experts={self.num_experts}; choose an expert-parallel size that divides it"
                )
            if self.moe_ffn_hidden_size % etp:
                raise ValueError(
                    f"--expert-tensor-parallel-size {etp} does not divide moe_ffn_hidden_size="
                    f"{self.moe_ffn_hidden_size}; choose one that divides it (or --moe-tp-extend-ep)"
                )
            shared = self.moe_shared_expert_intermediate_size
            if shared and shared % tp:
                raise ValueError(
                    f"--tensor-model-parallel-size {tp} does not divide the shared expert's "
                    f"intermediate size {shared}; choose a TP size that divides it"
                )
        elif ep != 1:
            raise ValueError(
                f"--expert-model-parallel-size {ep} needs a mixture-of-experts model, but this {self.family} "
                f"model is dense; drop the flag"
            )
        problems = []
        if self.is_mla:  # megatron's MLA splits the down projections' output rows over TP too
            if self.q_lora_rank is not None and self.q_lora_rank % tp:
                problems.append(f"q_lora_rank={self.q_lora_rank}")
            if (self.kv_lora_rank + self.qk_rope_head_dim) % tp:
                problems.append(f"kv_lora_rank + qk_rope_head_dim={self.kv_lora_rank + self.qk_rope_head_dim}")
        if self.num_attention_heads % tp:
            problems.append(f"num_attention_heads={self.num_attention_heads}")
        if self.num_query_groups % tp:
            problems.append(f"num_query_groups (key/value heads)={self.num_query_groups}")
        if 0 in self.moe_layers() and self.ffn_hidden_size % tp:
            problems.append(f"ffn_hidden_size={self.ffn_hidden_size}")
        if self.vocab_size % tp:
            problems.append(f"vocab_size={self.vocab_size}")
        if problems:
            raise ValueError(
                f"--tensor-model-parallel-size {tp} does not divide {', '.join(problems)}; "
                f"choose a TP size that divides each of them"
            )
        if self.num_layers % pp:
            raise ValueError(
                f"--pipeline-model-parallel-size {pp} does not divide num_layers={self.num_layers}; "
                f"choose a PP size that divides the number of layers"
            )


# ---------------------------------------------------------------------------------------- MoE config keys

def _moe_layer_pattern(config: Dict[str, Any], num_layers: int) -> Optional[List[int]]:
    """Qwen-MoE's rule: layer i is sparse unless listed in mlp_only_layers or off decoder_sparse_step."""
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    pattern = [0 if (i in dense or (i + 1) % step) else 1 for i in range(num_layers)]
    return None if all(pattern) else pattern


def _moe_fields_from_hf(family: str, config: Dict[str, Any]) -> Dict[str, Any]:
    if family not in MOE_FAMILIES:
        return {}
    if config.get("router_jitter_noise"):
        raise UnsupportedModelError(
            f"router_jitter_noise={config['router_jitter_noise']} is not supported (set it to 0.0)")
    # transformers 5 saves Qwen-MoE's `num_experts` as `num_local_experts` (its attribute map); the Hub has both.
    num_experts = config.get("num_experts", config.get("num_local_experts"))
    if not num_experts:
        raise UnsupportedModelError(f"{family} config.json has neither num_experts nor num_local_experts")
    if family == "mixtral":
        # Mixtral: softmax over all experts, top-k, renormalised; experts use intermediate_size.
        return dict(
            num_experts=num_experts,
            moe_ffn_hidden_size=config["intermediate_size"],
            moe_router_topk=config["num_experts_per_tok"],
            moe_router_pre_softmax=False,
            moe_aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)),
        )
    fields_ = dict(
        num_experts=num_experts,
        moe_ffn_hidden_size=config["moe_intermediate_size"],
        moe_router_topk=config["num_experts_per_tok"],
        moe_router_pre_softmax=not config.get("norm_topk_prob", False),
        moe_aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)),
        moe_layer_pattern=_moe_layer_pattern(config, config["num_hidden_layers"]),
    )
    if family == "qwen2_moe":
        fields_.update(moe_shared_expert_intermediate_size=config["shared_expert_intermediate_size"],
                       moe_shared_expert_gate=True)
    return fields_


def _moe_fields_to_hf(spec: "ArchitectureSpec") -> Dict[str, Any]:
    if spec.family == "mixtral":
        if spec.moe_router_pre_softmax or spec.moe_layer_pattern is not None:
            raise UnsupportedModelError("mixtral renormalises its top-k and has no dense layers")
        return {
            "num_local_experts": spec.num_experts,
            "num_experts_per_tok": spec.moe_router_topk,
            "intermediate_size": spec.moe_ffn_hidden_size,
            "router_aux_loss_coef": spec.moe_aux_loss_coeff,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    out = {
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.moe_router_topk,
        "moe_intermediate_size": spec.moe_ffn_hidden_size,
        "norm_topk_prob": not spec.moe_router_pre_softmax,
        "router_aux_loss_coef": spec.moe_aux_loss_coeff,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, moe in enumerate(spec.moe_layers()) if not moe],
        "use_sliding_window": False,
    }
    if spec.family == "qwen2_moe":
        out.update(shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size, qkv_bias=True)
    if spec.family == "qwen3_moe":
        out["attention_bias"] = False
    return out
