#!/usr/bin/env bash
# Llama-3.2-1B-Instruct (Hugging Face) -> Megatron-core, the actor / reference weights of trl_ppo.
set -euo pipefail
HF_DIR=${HF_DIR:-./model_from_hf/llama32_1b_hf}
SAVE_DIR=${SAVE_DIR:-./model_weights/llama32_1b_mcore}
TP=${TP:-1}; PP=${PP:-1}
${PYTHON:-python} convert_ckpt.py --load-model-type hf --save-model-type mg \
    --load-dir "$HF_DIR" --save-dir "$SAVE_DIR" --model-type-hf llama3 \
    --target-tensor-parallel-size "$TP" --target-pipeline-parallel-size "$PP" --params-dtype bf16
