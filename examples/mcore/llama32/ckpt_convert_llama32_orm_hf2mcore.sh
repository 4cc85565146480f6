#!/usr/bin/env bash
# A reward model (LlamaForSequenceClassification, num_labels=1) -> Megatron-core with a value head (--orm):
# the reward and the initial critic of trl_ppo.
set -euo pipefail
HF_DIR=${HF_DIR:-./model_from_hf/llama32_1b_rm_hf}
SAVE_DIR=${SAVE_DIR:-./model_weights/llama32_1b_rm_mcore}
TP=${TP:-1}; PP=${PP:-1}
${PYTHON:-python} convert_ckpt.py --load-model-type hf --save-model-type mg --orm \
    --load-dir "$HF_DIR" --save-dir "$SAVE_DIR" --model-type-hf llama3 \
    --target-tensor-parallel-size "$TP" --target-pipeline-parallel-size "$PP" --params-dtype bf16
