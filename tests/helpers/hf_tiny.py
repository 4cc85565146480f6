"""Tiny random Hugging Face models (fp32) of each supported family, saved to a folder, for tests to reuse.

Every weight is random and non-trivial: RMSNorm weights are 1 + noise (not all ones), the Qwen2 q/k/v
biases are noise (not zeros), Qwen3 q/k norms likewise, so a converter that drops, swaps or mis-splits a
tensor changes the logits. The configs differ per family on purpose (grouped-query attention with
different group sizes, an explicit head_dim != hidden/heads for Qwen3, llama3 RoPE scaling, rope_theta)
and all of them split 2 ways for tensor parallelism (heads, key/value heads, ffn and vocab even) and
2 ways for pipeline parallelism (even layer count). The mixture-of-experts families (MOE_FAMILIES,
MOE_VARIANTS) also split 2 ways for expert parallelism and expert TP (even expert count and widths);
their router (and Qwen2-MoE's shared_expert_gate) weights are random like every other matrix.

    from tests.helpers.hf_tiny import save_tiny
    path = save_tiny("qwen2", tmp_path / "qwen2", tie=True)                  # *ForCausalLM
    path = save_tiny("llama", tmp_path / "rm", seq_cls=True)                # *ForSequenceClassification
    model = build_tiny("qwen3")                                              # in memory, no folder
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
# DeepSeek-V3 (multi-latent attention, YaRN, sigmoid group-limited routing with expert bias, shared expert,
# first_k_dense_replace dense layers): DEEPSEEK_VARIANTS below.

# Architecture per family; every count divides by 2 (TP=2) and num_hidden_layers by 2 (PP=2).
_BASE: Dict[str, Dict[str, Any]] = {
    "llama": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                  rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8192},
                  max_position_embeddings=16384),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  rope_theta=1000000.0),
    "qwen3": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  rope_theta=1000000.0),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                    rope_theta=10000.0, sliding_window=None),
    # Mixtures of experts: the expert width differs from the dense width (moe_intermediate_size !=
    # intermediate_size) so a converter that mixes them up fails on shapes; 4 or 8 experts, top-2.
    "qwen3_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, rope_theta=1000000.0, router_aux_loss_coef=0.001),
    "qwen2_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_experts=4,
                      num_experts_per_tok=2, shared_expert_intermediate_size=80, norm_topk_prob=False,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0, router_aux_loss_coef=0.001),
    "mixtral": dict(hidden_size=64, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=8, rope_theta=1000000.0,
                    sliding_window=None, router_aux_loss_coef=0.02),
    # Every MLA width differs (q_lora 24, kv_lora 16, nope 16, rope 8, value 12) so a swapped tensor fails on
    # shapes; routed_scaling_factor != 1, 4 groups of which 2 are kept, YaRN factor 4 past 64 positions with
    # mscale != mscale_all_dim (attention factor and softmax scale both != 1). Layer 0 is dense.
    "deepseek_v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
                        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=4,
                        routed_scaling_factor=2.5, n_group=4, topk_group=2, first_k_dense_replace=1,
                        norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True, attention_bias=False,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7,
                                         "rope_theta": 10000.0},
                        max_position_embeddings=256),
}

# DeepSeek-V3 variants: (config overrides). "noqlora": q_proj instead of the q LoRA pair (DeepSeek-V2-Lite
# style), 2 groups keep 1, top-2, 2 shared experts, 3 layers of which 2 dense, plain RoPE (no YaRN).
DEEPSEEK_VARIANTS: Dict[str, dict] = {
    "deepseek_v3": {},
    "deepseek_v3-noqlora": dict(q_lora_rank=None, n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=2,
                                first_k_dense_replace=2, num_layers=4, routed_scaling_factor=1.5,
                                rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
}

# MoE variants: (family, config overrides). "qwen3_moe-mixed" has a dense layer (mlp_only_layers, dense
# tensor names, intermediate_size) between sparse ones and HF norm_topk_prob=False (megatron pre-softmax).
MOE_VARIANTS: Dict[str, tuple] = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-mixed": ("qwen3_moe", dict(mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen2_moe": ("qwen2_moe", {}),
    "mixtral": ("mixtral", {}),
}

PAD_TOKEN_ID = 0


def tiny_config(family: str, *, tie: bool = False, num_layers: int = 2, vocab_size: int = 256, **overrides):
    """The transformers config of a tiny `family` model (fp32, eager attention)."""
    from transformers import AutoConfig

    if family not in _BASE:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    kwargs = dict(max_position_embeddings=512)
    kwargs.update(_BASE[family])
    kwargs.update(num_hidden_layers=num_layers, vocab_size=vocab_size, tie_word_embeddings=tie,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  pad_token_id=PAD_TOKEN_ID)
    kwargs.update(overrides)
    config = AutoConfig.for_model(family, **kwargs)
    config._attn_implementation = "eager"
    return config


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Re-draw every parameter: matrices ~ N(0, 0.05), norms ~ 1 + N(0, 0.1), biases ~ N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            value = 0.1 * noise
        else:
            value = 0.05 * noise
        param.copy_(value.to(param.dtype))
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: not zero, so it matters
            buffer.copy_(0.05 * torch.randn(buffer.shape, generator=gen, dtype=torch.float32))
    return model


def build_tiny(family: str, *, tie: bool = False, seq_cls: bool = False, seed: int = 0, **overrides):
    """A random fp32 `*ForCausalLM` (or `*ForSequenceClassification` with num_labels=1), in eval mode."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = tiny_config(family, tie=tie, **overrides)
    if seq_cls:
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if tie and not seq_cls:
        model.tie_weights()
    randomize_(model, seed)
    if tie and not seq_cls:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def write_tokenizer(path, vocab_size: int = 256) -> None:
    """A tiny word-level fast tokenizer (offline) whose ids fit the tiny vocabularies."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(4, vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.save_pretrained(os.fspath(path))


# SmolLM2's ChatML shape with a default system turn (the character tokenizer's template)
CHAR_CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_char_tokenizer(path, *, split: str = r"[\s\S]", mark_specials: bool = True) -> str:
    """A character-level fast tokenizer with SmolLM2's ids 0/1/2 = <|endoftext|>/<|im_start|>/<|im_end|> and
    `CHAR_CHATML` as its chat template, saved to `path` (returned as str). `split`: the regex of one token (the
    default takes newlines as tokens too; "." leaves them out); `mark_specials`: the three are special tokens."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(split), behavior="isolated")
    tk.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")
    if mark_specials:
        fast.add_special_tokens({"additional_special_tokens": specials})
    fast.chat_template = CHAR_CHATML
    fast.save_pretrained(os.fspath(path))
    return os.fspath(path)


def save_tiny(family: str, path, *, tie: bool = False, seq_cls: bool = False, seed: int = 0,
              tokenizer: bool = False, **overrides) -> str:
    """Save a tiny random model (safetensors, fp32) to `path`; returns the path as str."""
    path = os.fspath(path)
    model = build_tiny(family, tie=tie, seq_cls=seq_cls, seed=seed, **overrides)
    model.save_pretrained(path)
    if tokenizer:
        write_tokenizer(path, model.config.vocab_size)
    return path


def read_config(path) -> Dict[str, Any]:
    with open(os.path.join(os.fspath(path), "config.json")) as f:
        return json.load(f)


def deepseek_variant(name, **extra):
    overrides = dict(DEEPSEEK_VARIANTS[name])
    overrides.update(extra)
    return overrides
