#!/usr/bin/env bash
# GRPO on DeepSeek-V3 / R1 (671B): NOT RUNNABLE YET. This program cannot load the DeepSeek-V3 family, so the script
# stops at once (exit 2) with the list of what is missing, before anything is launched.
#
# What was checked (megatron-core 0.16.1, local layer spec, CPU, fp32): a tiny DeepSeek-V3 built from
# megatron's MLATransformerConfig (multi-latent attention with q/kv LoRA projections and their RMSNorms, YaRN RoPE on
# the rope part, sigmoid routing with expert bias, group-limited top-k, routed scaling factor, a shared expert,
# dense first layers through moe_layer_freq) gives transformers' DeepseekV3ForCausalLM logits to 1e-6 at TP 1 and
# TP 2, trains (forward + backward), and generates the same greedy tokens through mindspeed_llm's static KV cache.
# The missing pieces are in this program, not in megatron:
#   1. mindspeed_llm/models/spec.py: no deepseek_v3 family (MLA sizes, YaRN parameters, n_group / topk_group,
#      routed_scaling_factor, e_score_correction_bias, first_k_dense_replace, n_shared_experts).
#   2. mindspeed_llm/models/builder.py: no MLATransformerConfig; megatron's local DotProductAttention refuses the
#      k_channels / v_channels MLA passes it (TypeError), and MultiLatentAttention takes Transformer Engine for
#      present without it (isinstance(..., TELinear) on a mock: TypeError) unless its HAVE_TE is patched to False.
#   3. mindspeed_llm/models/forward_layout.py: MLA keeps its rotary embedding in every attention layer (GPTModel has
#      none), so packed rows' position ids would be ignored silently.
#   4. mindspeed_llm/patches/inference.py: the decode-step attention assumes the value head dim equals the key's
#      (MLA: 128 vs 192), a RuntimeError at the first decode step.
#   5. convert_ckpt.py: no MLA / router-bias mapping, no FP8 block dequantisation (weight_scale_inv) of the
#      released checkpoint, no skipping of the multi-token-prediction layer 61.
#   6. 61 layers need an uneven pipeline split (MindSpeed-RL: 9,10,10,10,11,11 over PP 6); PP must divide the
#      layer count here.
# Intended layout once those land (MindSpeed-RL's recipe on 8-device nodes): 48 nodes, TP 4, PP 6, EP 16 with
# --moe-tp-extend-ep (experts over 64 ranks), --moe-router-load-balancing-type seq_aux_loss, alltoall dispatcher,
# --moe-routing-replay, 32 samples per prompt.
set -euo pipefail
cd "$(dirname "$0")/../../.."
echo "error: $0: DeepSeek-V3 (model_type deepseek_v3) is not supported by this program yet: mindspeed_llm/models/spec.py," \
     "builder.py and convert_ckpt.py have no multi-latent-attention family (see the list at the top of this script)." \
     "Nothing was launched. Supported families: python -c 'from mindspeed_llm.models.spec import SUPPORTED_FAMILIES;" \
     "print(SUPPORTED_FAMILIES)'; for a mixture of experts see examples/mcore/qwen3_moe/grpo_qwen3_30b_a3b.sh" >&2
exit 2
