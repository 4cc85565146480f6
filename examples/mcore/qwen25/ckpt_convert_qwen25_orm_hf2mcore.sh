#!/usr/bin/env bash
# A Qwen2.5 reward model (Hugging Face Qwen2ForSequenceClassification, num_labels=1, the same shape as the
# actor: here Qwen2.5-32B) -> Megatron-core with a value head (--orm): the critic's starting point of trl_ppo
# (ppo_qwen25_32b.sh), and the reward model when the run scores with it. Convert it at the run's TP / PP: a
# checkpoint is loaded at the layout it was written with.
set -euo pipefail
HF_DIR=${HF_DIR:-./model_from_hf/qwen25_32b_rm}
SAVE_DIR=${SAVE_DIR:-./model_weights/qwen25_32b_rm_mcore}
TP=${TP:-8}; PP=${PP:-4}
${PYTHON:-python} convert_ckpt.py --load-model-type hf --save-model-type mg --orm \
    --load-dir "$HF_DIR" --save-dir "$SAVE_DIR" --model-type-hf qwen25 \
    --target-tensor-parallel-size "$TP" --target-pipeline-parallel-size "$PP" --params-dtype bf16
