"""Speed patches for rollout generation on megatron-core 0.16.1 (devices: cpu, cuda, npu).

All are exact: they change *how* a step is computed, never what. Greedy rollouts stay token for token
equal to `transformers` and to megatron's unpatched code (tests/dist/test_generate.py, TP1/TP2/PP2, batched and
stepwise prefill), and a training forward (autograd on, no inference context) reaches none of the new code.
Patch 1 serves megatron's static KV cache (the `engine="static"` path, `inference/static_engine.py`); 2-4 also
serve the continuous-batching engine (`inference/continuous.py`), whose decode steps are plain eval forwards
against its own cache (sq < sk, autograd off).

What megatron-core 0.16.1 does at every decode step (local spec, `flash_decode=False`), per layer:

1. `Attention._adjust_key_value_for_inference` writes the key into the static cache *before* rotary and
   returns `k_pos_emb[:sequence_end]`; `Attention.forward` then applies rotary to the whole cached key
   `[sequence_end, b, ng, hn]` (cos/sin of every slot, rotate-half, cat) again, so the work per step
   grows with the sequence although only the one new key needs it.
2. `DotProductAttention.forward` materialises `repeat_interleave` copies of the whole key and value cache
   for grouped-query attention (`np // ng` times) before its baddbmm/bmm, and forks the tensor-parallel RNG
   tracker around a dropout that is the identity in eval mode.
3. Every linear layer goes through `LinearWithGradAccumulationAndAsyncCommunication.apply` (autograd
   Function + autocast decorator + ctx bookkeeping), also under `torch.no_grad()` where the Function only
   computes `input @ weight.t() (+ bias)`: about 17 calls per decode step for a 4-layer model.
4. Around them, `copy_to_tensor_model_parallel_region` / `reduce_from_tensor_model_parallel_region` build an
   autograd Function (about 10 us each on CPU) whose forward is the identity / megatron's `_reduce`.

Megatron's own way out of 1. and 2., `config.flash_decode=True`, is no option here: its decode step calls
flash-attn's `flash_attn_with_kvcache` (CUDA only), and without flash-attn its prefill/step fallback
`apply_rotary_pos_emb_with_cos_sin` passes the cos/sin *values* to `_apply_rotary_pos_emb_bshd`, which
takes cos/sin of them again: wrong rotary, wrong tokens.

The patches:

1. `Attention._adjust_key_value_for_inference` (static context, eval, rotary on, `flash_decode` off):
   rotate the new keys with the embeddings of their own slots `[sequence_len_offset, + s)` using megatron's
   `apply_rotary_pos_emb` (same config, same mscale) before they are cached, and return
   `(q_pos_emb[start:end], None)`: `Attention.forward` rotates the query exactly as before and skips the
   key (it skips a `None` embedding by design). Slot s of the cache holds rotary(k_s, s) once instead of
   k_s rotated at every later step; the scores are the same. Every write to a static cache goes through
   this function, so the cache is consistently post-rotary.
2. `DotProductAttention.forward` in eval mode for a query shorter than the keys (a step against a KV cache;
   a plain forward has sq == sk and keeps megatron's code): each key/value group is multiplied with its
   `np // ng` query heads (the heads `repeat_interleave` pairs it with, stacked along the query axis), so
   the cache is read in place. Same baddbmm (alpha = softmax_scale, the global "mpu" buffer), the same
   `scale_mask_softmax` module on the same [b, np, sq, sk] scores, dropout skipped (identity in eval).
   It acts on megatron's local attention (`--attention-backend local`) only: the default fused core attention
   (`mindspeed_llm/models/attention.py`) overrides `forward` and reads grouped heads in place itself.
3. `linear_with_grad_accumulation_and_async_allreduce` with autograd off and no sequence parallelism:
   return `torch.matmul(input, weight.t())` (+ bias), the very expression the Function's forward
   evaluates in that case, without building the Function.
4. `copy_to_` / `reduce_from_tensor_model_parallel_region` as called by megatron's linear layers, autograd off:
   the Function's forward (the input itself / `_reduce(input, group)`, the TP all-reduce) without the Function.

Why each is exact on every device (they are plain torch and megatron functions, nothing device-specific, so
they are registered for the CPU, CUDA and NPU alike):

1. the very function megatron applies to the cached keys (`apply_rotary_pos_emb`, same config, mscale and CP
   group; with `apply_rope_fusion` the same fused kernel) on the same key values and the same per-slot rows:
   rotary is elementwise per slot, so rotating slot s once before caching gives the bits megatron's
   re-rotation of slot s gives at every step (the cache holds the key in the same dtype either way).
2. the same products and sums in the same dtype: each score is q_h . k_g over the head dim, each context row
   probs . v_g, and megatron's own `scale_mask_softmax` module (fused or not, decided by the same
   [b, np, sq, sk] shape) sits in between; only the batching of the matrix products differs (per_group * sq
   query rows per key/value group instead of a repeated copy per head), which changes rounding only where a
   BLAS / cuBLAS kernel picks a shape-dependent reduction order over the head dim (the tests bound the
   log-probs at 1e-5 and require equal tokens).
3. the Function's forward is `torch.matmul(input, weight.t()) (+ bias)` when sequence parallelism is off,
   under the same autocast state (its `custom_fwd` casts nothing); that expression is evaluated as is.
4. the Functions' forwards are the identity and megatron's `_reduce` (the TP all-reduce, nothing at TP=1).

Numbers: benchmarks/generate.py (see the docstring there and the commit message).
"""

from __future__ import annotations

import torch

from mindspeed_llm.patches import register

DEVICES = ("cpu", "cuda", "npu")  # exact everywhere (module docstring); CUDA-graph capture-safe (no host syncs)


def _rotary_before_cache_applies(attention, inference_context, rotary_pos_emb) -> bool:
    return (
        inference_context is not None
        and not attention.training
        and inference_context.is_static_batching()
        and not attention.config.flash_decode
        and isinstance(rotary_pos_emb, tuple)
        and len(rotary_pos_emb) == 2
        and rotary_pos_emb[0] is not None
        and rotary_pos_emb[1] is not None
    )


@register(
    "megatron.core.transformer.attention.Attention._adjust_key_value_for_inference",
    "static KV cache: megatron caches keys before rotary and re-rotates the whole cache at every decode step; "
    "rotate each new key once, before it is cached (exact: the same rotary per slot)",
    devices=DEVICES,
)
def _rotary_before_cache(original):
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.transformer import attention as attention_module

    mscale_of = attention_module._yarn_get_concentration_factor_from_config  # what Attention.forward uses

    def _adjust_key_value_for_inference(self, inference_context, query, key, value, rotary_pos_emb=None,
                                        *args, **kwargs):
        if kwargs.get("inference_params") is not None or not _rotary_before_cache_applies(
                self, inference_context, rotary_pos_emb):
            return original(self, inference_context, query, key, value, rotary_pos_emb, *args, **kwargs)
        q_pos_emb, k_pos_emb = rotary_pos_emb
        start = inference_context.sequence_len_offset
        end = start + key.size(0)
        if end > k_pos_emb.size(0):  # past the end of the cache: megatron raises its own error
            return original(self, inference_context, query, key, value, rotary_pos_emb, *args, **kwargs)
        key = apply_rotary_pos_emb(key, k_pos_emb[start:end], config=self.config, mscale=mscale_of(self.config),
                                   cp_group=self.pg_collection.cp)
        query, key, value, _, attn_mask_type, block_table = original(
            self, inference_context, query, key, value, None, *args, **kwargs)
        return query, key, value, (q_pos_emb[start:end], None), attn_mask_type, block_table

    _adjust_key_value_for_inference.__wrapped__ = original
    return _adjust_key_value_for_inference


@register(
    "megatron.core.transformer.dot_product_attention.DotProductAttention.forward",
    "steps against a KV cache: megatron repeat_interleaves the whole key/value cache for grouped-query attention "
    "at every step; multiply each key/value group with its query heads in place (eval and sq < sk only)",
    devices=DEVICES,
)
def _grouped_decode_attention(original):
    from megatron.core import parallel_state

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if (self.training or attention_bias is not None or packed_seq_params is not None
                or query.size(0) >= key.size(0)):
            return original(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        sq, b, heads, hn = query.shape
        sk, groups = key.size(0), key.size(2)
        hv = value.size(-1)  # the value head dim: != hn under multi-latent attention (DeepSeek-V3)
        per_group = heads // groups  # query heads g * per_group ... (g + 1) * per_group - 1 read group g
        # [sq, b, np, hn] -> [b, np, sq, hn] -> [b * ng, per_group * sq, hn]
        q = query.permute(1, 2, 0, 3).reshape(b * groups, per_group * sq, hn)
        # [sk, b, ng, hn] -> [b * ng, hn, sk] and [sk, b, ng, hv] -> [b * ng, sk, hv]: views of the cache
        k = key.reshape(sk, b * groups, hn).permute(1, 2, 0)
        v = value.reshape(sk, b * groups, hv).transpose(0, 1)
        scores = parallel_state.get_global_memory_buffer().get_tensor(
            (b * groups, per_group * sq, sk), q.dtype, "mpu")
        scores = torch.baddbmm(scores, q, k, beta=0.0, alpha=self.softmax_scale)
        probs = self.scale_mask_softmax(scores.view(b, heads, sq, sk), attention_mask, self.softmax_offset)
        context = torch.bmm(probs.reshape(b * groups, per_group * sq, sk), v)  # dropout: identity in eval
        # [b * ng, per_group * sq, hv] -> [b, np, sq, hv] -> [sq, b, np * hv]
        context = context.view(b, heads, sq, hv).permute(2, 0, 1, 3).contiguous()
        return context.view(sq, b, self.hidden_size_per_partition)

    forward.__wrapped__ = original
    return forward


@register(
    "megatron.core.tensor_parallel.layers.linear_with_grad_accumulation_and_async_allreduce",
    "under torch.no_grad() the autograd Function around each linear layer only computes input @ weight.t() "
    "(+ bias); compute exactly that without building the Function (autograd off, no sequence parallelism)",
    devices=DEVICES,
)
def _no_grad_linear(original):
    def linear_with_grad_accumulation_and_async_allreduce(input, weight, bias, gradient_accumulation_fusion,
                                                          allreduce_dgrad, sequence_parallel, *args, **kwargs):
        if torch.is_grad_enabled() or sequence_parallel:
            return original(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                            *args, **kwargs)
        output = torch.matmul(input, weight.t())
        return output if bias is None else output + bias

    linear_with_grad_accumulation_and_async_allreduce.__wrapped__ = original
    linear_with_grad_accumulation_and_async_allreduce.warned = getattr(original, "warned", False)
    return linear_with_grad_accumulation_and_async_allreduce


def _forward_only(original, forward):
    """`original(input_, group)` with grad on; else the autograd Function's `forward(input_, group)` as is."""
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    def region(input_, group=None):
        if torch.is_grad_enabled():
            return original(input_, group)
        return forward(input_, get_tensor_model_parallel_group_if_none(group))

    region.__wrapped__ = original
    region.__name__ = original.__name__
    return region


@register(
    "megatron.core.tensor_parallel.layers.copy_to_tensor_model_parallel_region",
    "under torch.no_grad() the autograd Function before each column-parallel linear only returns its input; "
    "return it without building the Function (~10 us a call, 2 calls per layer per step)",
    devices=DEVICES,
)
def _no_grad_copy_to_tp_region(original):
    return _forward_only(original, lambda input_, group: input_)  # _CopyToModelParallelRegion.forward


@register(
    "megatron.core.tensor_parallel.layers.reduce_from_tensor_model_parallel_region",
    "under torch.no_grad() the autograd Function after each row-parallel linear only all-reduces (nothing at "
    "TP=1); call megatron's _reduce directly without building the Function",
    devices=DEVICES,
)
def _no_grad_reduce_from_tp_region(original):
    from megatron.core.tensor_parallel.mappings import _reduce

    return _forward_only(original, _reduce)  # _ReduceFromModelParallelRegion.forward
