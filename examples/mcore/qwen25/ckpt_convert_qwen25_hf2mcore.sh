#!/usr/bin/env bash
# Qwen2.5 (Hugging Face) -> Megatron-core: the initial actor (and reference) of grpo or trl_ppo (7B by default;
# the 32B PPO launcher sets HF_DIR, SAVE_DIR, TP=8 PP=4).
set -euo pipefail
HF_DIR=${HF_DIR:-./model_from_hf/qwen25_7b}
SAVE_DIR=${SAVE_DIR:-./model_weights/qwen25_7b_mcore}
TP=${TP:-4}; PP=${PP:-1}
${PYTHON:-python} convert_ckpt.py --load-model-type hf --save-model-type mg \
    --load-dir "$HF_DIR" --save-dir "$SAVE_DIR" --model-type-hf qwen25 \
    --target-tensor-parallel-size "$TP" --target-pipeline-parallel-size "$PP" --params-dtype bf16
