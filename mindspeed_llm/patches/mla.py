"""Patches that let megatron-core 0.16.1's multi-latent attention (DeepSeek-V3) run on the local layer spec
(all devices; without Transformer Engine).

1. `MultiLatentAttention.__init__` builds its core attention with `k_channels=` / `v_channels=` (the key head dim
   nope + rope, and the value head dim), keywords only TE's attention takes: the local `DotProductAttention`
   raises TypeError. Its math needs neither: the scores read the head dim from the tensors, the softmax scale
   comes in as `softmax_scale` (MLA passes its YaRN-corrected one) and the output width is
   `config.kv_channels`, which `build_model` sets to the value head dim. The wrapper accepts the two keywords,
   checks that the value width agrees with `kv_channels`, and drops them.
2. `multi_latent_attention.HAVE_TE` is True whenever `megatron.core.extensions.transformer_engine` imports,
   which it does without TE (it mocks the package), so `MultiLatentAttention.__init__` runs
   `isinstance(self.linear_proj, TELinear)` against a mock: TypeError. The flag is made to mean what it says:
   TE really importable.
3. `TopKRouter._apply_expert_bias` (DeepSeek-V3's aux-loss-free balancing counts the tokens each expert gets in a
   training forward) masks padding with `routing_map & ~padding_mask`: routing_map is [tokens, experts], the
   padding mask [tokens], so the broadcast fails (RuntimeError) whenever megatron's MoE gets a padding mask, as
   the RL passes give it. The mask is applied per token (unsqueezed over the experts); the count is otherwise
   megatron's.
4. `MLASelfAttention.get_query_key_value_tensors` squeezes the batch dim of its compressed q / kv whenever
   `packed_seq_params` is not None (it assumes the `thd` format); the packed prompt groups reach the fused core
   attention as `sbhd` params (`mindspeed_llm/models/attention.py`), and a micro-batch of one row would lose its
   batch dim (wrong shapes, a wrong rotary broadcast). For any other format than `thd` the function gets None: the
   only other thing it reads from them is the rotary length, `max_seqlen`, which equals the hidden states' length.
"""

from __future__ import annotations

import importlib.util

from mindspeed_llm.patches import register


@register(
    "megatron.core.transformer.dot_product_attention.DotProductAttention.__init__",
    "MLA builds its core attention with k_channels/v_channels (TE's keywords); the local attention takes neither "
    "and needs neither (value width = config.kv_channels, softmax_scale passed in)",
    devices=("cpu", "cuda", "npu"),
)
def _accept_mla_channels(original):
    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        config = kwargs.get("config", args[0] if args else None)
        if v_channels is not None and config is not None and v_channels != config.kv_channels:
            raise ValueError(
                f"multi-latent attention: value head dim {v_channels} != kv_channels {config.kv_channels}; the local "
                "attention's output width is kv_channels, so set kv_channels to v_head_dim")
        original(self, *args, **kwargs)

    __init__.__wrapped__ = original
    return __init__


@register(
    "megatron.core.transformer.multi_latent_attention.HAVE_TE",
    "HAVE_TE is True when megatron's TE extension module imports, which it does without TE (mocked); "
    "MultiLatentAttention then calls isinstance(..., TELinear) on a mock and raises TypeError",
    devices=("cpu", "cuda", "npu"),
)
def _mla_have_te(original):
    return bool(original) and importlib.util.find_spec("transformer_engine") is not None


@register(
    "megatron.core.transformer.moe.router.TopKRouter._apply_expert_bias",
    "the expert-bias token count masks padding with routing_map [tokens, experts] & ~padding_mask [tokens]: a "
    "broadcast error whenever a padding mask is given; mask per token",
    devices=("cpu", "cuda", "npu"),
)
def _expert_bias_padding(original):
    import torch

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1).bool()
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    _apply_expert_bias.__wrapped__ = original
    return _apply_expert_bias


@register(
    "megatron.core.transformer.multi_latent_attention.MLASelfAttention.get_query_key_value_tensors",
    "MLA squeezes the batch dim of its compressed q/kv whenever packed_seq_params is given, assuming the thd format; "
    "the packed prompt groups come as sbhd params (models/attention.py) and a micro-batch of one row would lose it",
    devices=("cpu", "cuda", "npu"),
)
def _mla_sbhd_packed_params(original):
    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, position_ids=None,
                                    packed_seq_params=None, *args, **kwargs):
        if packed_seq_params is not None and packed_seq_params.qkv_format != "thd":
            # everything else it reads from sbhd params (the rotary length) equals the hidden states' own length
            packed_seq_params = None
        return original(self, hidden_states, key_value_states, position_ids, packed_seq_params, *args, **kwargs)

    get_query_key_value_tensors.__wrapped__ = original
    return get_query_key_value_tensors
