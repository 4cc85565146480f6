#!/usr/bin/env bash
# The trained DeepSeek-V3 actor (Megatron-core, any layout) -> Hugging Face (model.safetensors shards and a clean
# config.json: no quantization_config, num_nextn_predict_layers 0 as the MTP layer is not exported).
set -euo pipefail
LOAD_DIR=${LOAD_DIR:-./ckpt/deepseek_v3_grpo/actor}
SAVE_DIR=${SAVE_DIR:-./model_from_hf/deepseek_v3_grpo_hf}
TOKENIZER_DIR=${TOKENIZER_DIR:-./model_from_hf/deepseek_v3_bf16}
${PYTHON:-python} convert_ckpt.py --load-model-type mg --save-model-type hf \
    --load-dir "$LOAD_DIR" --save-dir "$SAVE_DIR" --tokenizer-dir "$TOKENIZER_DIR"
