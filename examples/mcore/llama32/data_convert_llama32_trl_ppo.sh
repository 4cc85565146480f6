#!/usr/bin/env bash
# Alpaca prompts (train-*.parquet) -> the prompt dataset of trl_ppo, in Llama 3's chat template.
set -euo pipefail
mkdir -p ./dataset/llama32
${PYTHON:-python} preprocess_data.py \
    --input ${INPUT:-./dataset/alpaca/train-00000-of-00001-a09b74b3ef9c3b56.parquet} \
    --tokenizer-type PretrainedFromHF --tokenizer-name-or-path ${TOKENIZER:-./model_from_hf/llama32_1b_hf} \
    --output-prefix ./dataset/llama32/alpaca --handler-name PPOAlpacaStyleInstructionHandler \
    --prompt-type llama3 --max-prompt-length 256 --workers 4 --log-interval 1000
