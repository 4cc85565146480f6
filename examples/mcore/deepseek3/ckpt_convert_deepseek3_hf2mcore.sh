#!/usr/bin/env bash
# DeepSeek-V3 (Hugging Face, bf16) -> Megatron-core: the initial actor (and reference) of grpo_deepseek3_671b.sh, at
# its layout (TP 1, PP 1, EP 64 by default; a checkpoint is loaded at the layout it was written with).
# The released DeepSeek-V3 / R1 weights are FP8 with weight_scale_inv tensors: convert_ckpt.py refuses them naming
# the tensor; dequantise first with DeepSeek-V3's inference/fp8_cast_bf16.py (--input-fp8-hf-path ...
# --output-bf16-hf-path $HF_DIR), and drop quantization_config from the config.json next to the bf16 weights.
# The multi-token-prediction layer (model.layers.61.*) is skipped with a note.
set -euo pipefail
HF_DIR=${HF_DIR:-./model_from_hf/deepseek_v3_bf16}
SAVE_DIR=${SAVE_DIR:-./model_weights/deepseek_v3_mcore}
TP=${TP:-1}; PP=${PP:-1}; EP=${EP:-64}
${PYTHON:-python} convert_ckpt.py --load-model-type hf --save-model-type mg \
    --load-dir "$HF_DIR" --save-dir "$SAVE_DIR" \
    --target-tensor-parallel-size "$TP" --target-pipeline-parallel-size "$PP" \
    --target-expert-parallel-size "$EP" --params-dtype bf16
