"""Patches for megatron-core 0.16.1's activation recompute (all devices: both are exact wherever they run).

1. `tensor_parallel.checkpoint` (full recompute, and the selective `core_attn`, `mlp`, `moe`, `shared_experts`
   modules) runs the checkpointed function again inside the backward, where the per-forward settings of its
   micro-batch are gone: the rotary positions of packed rows and the replayed routing
   (`mindspeed_llm/forward_state.py`). The wrapper takes a snapshot of the live settings when the region is
   checkpointed and runs the function inside it, so the recompute sees its own micro-batch's settings, also
   when 1F1B recomputes a micro-batch after later ones ran their forwards. Without live settings it is
   megatron's call unchanged. (`CheckpointWithoutOutput`, the `layernorm` / `mla_up_proj` / `moe_act`
   modules, recomputes norms and projections that read none of these settings.)
2. `TransformerBlock._checkpointed_forward` with `recompute_method == 'block'` calls the layers past
   `recompute_num_layers` without the `padding_mask` the block was given (only the checkpointed layers get it as
   a checkpoint argument), so their MoE routers count padding tokens in the load-balancing loss and the
   per-expert token counts. The replacement runs the same loop, every layer with the mask; other methods, and
   fp8 / fp4 (Transformer Engine's checkpoint, not used by these models), go to megatron's own.
"""

from __future__ import annotations

from mindspeed_llm import forward_state
from mindspeed_llm.patches import register

ALL_DEVICES = ("cpu", "cuda", "npu")


@register(
    "megatron.core.tensor_parallel.checkpoint",
    "a recomputed region runs in the backward, outside its micro-batch's per-forward settings (packed rotary "
    "positions, replayed routing): it gets the snapshot taken when it was checkpointed",
    devices=ALL_DEVICES,
)
def _checkpoint_with_forward_state(original):
    def checkpoint(function, distribute_saved_activations, *args):
        saved = forward_state.snapshot()
        if not saved:
            return original(function, distribute_saved_activations, *args)

        def run(*inputs):
            with forward_state.restored(saved):
                return function(*inputs)

        return original(run, distribute_saved_activations, *args)

    return checkpoint


@register(
    "megatron.core.transformer.transformer_block.TransformerBlock._checkpointed_forward",
    "block recompute calls the layers it does not checkpoint without padding_mask: MoE routers counted padding "
    "tokens in their load-balancing loss and token counts",
    devices=ALL_DEVICES,
)
def _block_recompute_with_padding_mask(original):
    def _checkpointed_forward(self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                              attention_bias, packed_seq_params, use_inner_quantization_context, padding_mask=None):
        config = self.config
        if config.recompute_method != "block" or config.fp8 or config.fp4:
            return original(self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                            attention_bias, packed_seq_params, use_inner_quantization_context,
                            padding_mask=padding_mask)
        from megatron.core import tensor_parallel

        def layer_forward(index):
            def forward(hidden_states, attention_mask, context, context_mask, rotary_pos_emb, padding_mask):
                return self._get_layer(index)(
                    hidden_states=hidden_states, attention_mask=attention_mask, context=context,
                    context_mask=context_mask, rotary_pos_emb=rotary_pos_emb, attention_bias=attention_bias,
                    inference_context=None, packed_seq_params=packed_seq_params, padding_mask=padding_mask)
            return forward

        # the first recompute_num_layers layers of this pipeline stage are checkpointed, the others run as usual
        for index in range(self.num_layers_per_pipeline_rank):
            inputs = (hidden_states, attention_mask, context, context_mask, rotary_pos_emb, padding_mask)
            if index < config.recompute_num_layers:
                hidden_states, context = tensor_parallel.checkpoint(
                    layer_forward(index), config.distribute_saved_activations, *inputs)
            else:
                hidden_states, context = layer_forward(index)(*inputs)
        return hidden_states

    return _checkpointed_forward
