#!/usr/bin/env bash
# The trained actor (--save DIR/actor) of grpo_qwen3_30b_a3b.sh -> Hugging Face safetensors + config.json
# (Qwen3MoeForCausalLM). The checkpoint's own layout (TP, PP, expert parallel) is read from its shards: every
# expert-parallel shard is gathered, nothing to pass.
set -euo pipefail
LOAD_DIR=${LOAD_DIR:-./ckpt/qwen3_30b_a3b_grpo/actor}
SAVE_DIR=${SAVE_DIR:-./model_from_hf/qwen3_30b_a3b_grpo_hf}
TOKENIZER_DIR=${TOKENIZER_DIR:-./model_from_hf/qwen3_30b_a3b}
${PYTHON:-python} convert_ckpt.py --load-model-type mg --save-model-type hf \
    --load-dir "$LOAD_DIR" --save-dir "$SAVE_DIR" --tokenizer-dir "$TOKENIZER_DIR"
