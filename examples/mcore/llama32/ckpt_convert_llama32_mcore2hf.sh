#!/usr/bin/env bash
# The trained actor of a trl_ppo run (--save DIR/actor) -> Hugging Face safetensors + config.json.
set -euo pipefail
LOAD_DIR=${LOAD_DIR:-./ckpt/llama32_1b_trl_ppo/actor}
SAVE_DIR=${SAVE_DIR:-./model_from_hf/llama32_1b_trl_ppo_hf}
TOKENIZER_DIR=${TOKENIZER_DIR:-./model_from_hf/llama32_1b_hf}
${PYTHON:-python} convert_ckpt.py --load-model-type mg --save-model-type hf \
    --load-dir "$LOAD_DIR" --save-dir "$SAVE_DIR" --tokenizer-dir "$TOKENIZER_DIR"
