#!/usr/bin/env bash
# The trained actor (--save DIR/actor) of grpo or trl_ppo -> Hugging Face safetensors + config.json (LOAD_DIR).
set -euo pipefail
LOAD_DIR=${LOAD_DIR:-./ckpt/qwen25_7b_grpo/actor}
SAVE_DIR=${SAVE_DIR:-./model_from_hf/qwen25_7b_grpo_hf}
TOKENIZER_DIR=${TOKENIZER_DIR:-./model_from_hf/qwen25_7b}
${PYTHON:-python} convert_ckpt.py --load-model-type mg --save-model-type hf \
    --load-dir "$LOAD_DIR" --save-dir "$SAVE_DIR" --tokenizer-dir "$TOKENIZER_DIR"
