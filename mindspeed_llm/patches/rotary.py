"""megatron-core 0.16.1's unfused rotary embedding on CPU, without the work Hugging Face's Llama does not do.

`megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_bshd` is called twice per layer (query
and key) with the same `freqs` table, and each call takes `cos` and `sin` of the whole table, multiplies both by
`mscale` (1.0 for plain RoPE), and ends with `torch.cat((t, t_pass))`, a copy of the rotated query / key, also
when `t_pass` is empty (every model whose rotary dimension is its head dimension). Hugging Face computes cos / sin
once per forward and never copies. Measured in `benchmarks/update_profile.py` (the trl_ppo update, SmolLM2-135M,
30 layers): 120 cos / sin calls, 120 mscale multiplies and 60 query / key copies per forward and model.

The replacement returns the same tensors bit for bit: cos / sin of a table are kept from the previous call while
it is the same tensor object, unmodified (`_version`), not requiring grad, for the same dtype and mscale (one
entry: the layers of one forward share one table); `* mscale` is skipped at 1.0 (exact); the final `cat` is
skipped when nothing passes through (a cat with an empty tensor is a copy of `t`). Every other case (multi-latent
attention's interleave, a partial rotary dimension, mscale != 1) computes what megatron computes. CPU only: on an
accelerator a cached table could outlive a captured graph's inputs, and fused RoPE is the fast path there.
"""

from __future__ import annotations

import torch

from mindspeed_llm.patches import register

_TARGET = "megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_bshd"


class _CosSinCache:
    """The cos / sin of the last table seen (one entry); holds the table, so its identity cannot be reused."""

    def __init__(self):
        self.key = None
        self.value = None

    def get(self, freqs: torch.Tensor, mscale: float, dtype: torch.dtype):
        cacheable = not freqs.requires_grad and not torch.compiler.is_compiling()
        key = (freqs, freqs._version, mscale, dtype)
        if cacheable and self.key is not None and self.key[0] is freqs and self.key[1:] == key[1:]:
            return self.value
        cos_, sin_ = torch.cos(freqs), torch.sin(freqs)
        if mscale != 1.0:  # x * 1.0 == x exactly: megatron's multiply changes nothing then
            cos_, sin_ = cos_ * mscale, sin_ * mscale
        value = (cos_.to(dtype), sin_.to(dtype))
        self.key, self.value = (key, value) if cacheable else (None, None)
        return value


@register(
    _TARGET,
    "each query / key call takes cos and sin of the whole rotary table again, multiplies them by mscale = 1.0 and "
    "copies the rotated tensor through an empty cat: work Hugging Face's Llama does not do (same results)",
    devices=("cpu",),
)
def _rotary_without_recomputed_tables(original):
    from megatron.core.models.common.embeddings import rope_utils

    cache = _CosSinCache()

    def apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
        rot_dim = freqs.shape[-1]
        if multi_latent_attention or rot_dim != t.shape[-1]:
            return original(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        cos_, sin_ = cache.get(freqs, mscale, t.dtype)
        return (t * cos_) + (rope_utils._rotate_half(t, rotary_interleaved) * sin_)

    return apply_rotary_pos_emb_bshd
