"""`ModelSpec`: the architecture of a decoder-only model, independent of any framework.

It is read from a Hugging Face `config.json` (Llama, Qwen2/2.5, Qwen3, Mistral families) or from the
Megatron model flags, stored inside every Megatron checkpoint we write (so a stage can check that the
actor, reference, critic and reward agree on vocabulary), and written back as a clean `config.json`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Optional

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")

_HF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "LlamaForSequenceClassification"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3ForSequenceClassification"),
    "mistral": ("MistralForCausalLM", "MistralForSequenceClassification"),
}


class UnsupportedModelError(ValueError):
    pass


@dataclass
class ModelSpec:
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

    # ------------------------------------------------------------------ Hugging Face config.json
    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelSpec":
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
        if config.get("attention_bias") and family != "qwen2":
            raise UnsupportedModelError("attention_bias=true is only supported for the qwen2 family")
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
            add_qkv_bias=family == "qwen2",
            qk_layernorm=family == "qwen3",
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=eos,
        )

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
    def from_dict(cls, data: Dict[str, Any]) -> "ModelSpec":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def check_parallel(self, tp: int, pp: int) -> None:
        """Errors that name the flag when the model cannot be split TP x PP ways."""
        problems = []
        if self.num_attention_heads % tp:
            problems.append(f"num_attention_heads={self.num_attention_heads}")
        if self.num_query_groups % tp:
            problems.append(f"num_query_groups (key/value heads)={self.num_query_groups}")
        if self.ffn_hidden_size % tp:
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
