#!/usr/bin/env bash
# Qwen3-MoE (Hugging Face, e.g. Qwen3-30B-A3B) -> Megatron-core: the initial actor (and reference) of
# grpo_qwen3_30b_a3b.sh. Convert at the run's layout (a checkpoint is loaded at the layout it was written with):
# TP, PP and EP here are the launcher's --tensor-model-parallel-size, --pipeline-model-parallel-size and
# --expert-model-parallel-size (default TP 1, PP 1, EP 16: 8 of the 128 experts in each expert-parallel shard).
# MOE_TP_EXTEND_EP=1 adds --moe-tp-extend-ep (a run with TP > 1 that splits the experts over EP x TP ranks, whole,
# as MindSpeed does); 0 (default) tensor-splits each expert like the dense layers when TP > 1.
set -euo pipefail
HF_DIR=${HF_DIR:-./model_from_hf/qwen3_30b_a3b}
SAVE_DIR=${SAVE_DIR:-./model_weights/qwen3_30b_a3b_mcore}
TP=${TP:-1}; PP=${PP:-1}; EP=${EP:-16}; MOE_TP_EXTEND_EP=${MOE_TP_EXTEND_EP:-0}
EXTEND=""
case "$MOE_TP_EXTEND_EP" in
  1) EXTEND="--moe-tp-extend-ep" ;;
  0) ;;
  *) echo "error: MOE_TP_EXTEND_EP=$MOE_TP_EXTEND_EP must be 1 (--moe-tp-extend-ep) or 0" >&2; exit 2 ;;
esac
${PYTHON:-python} convert_ckpt.py --load-model-type hf --save-model-type mg \
    --load-dir "$HF_DIR" --save-dir "$SAVE_DIR" \
    --target-tensor-parallel-size "$TP" --target-pipeline-parallel-size "$PP" \
    --target-expert-parallel-size "$EP" $EXTEND --params-dtype bf16
