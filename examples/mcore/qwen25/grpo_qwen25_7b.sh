#!/usr/bin/env bash
# GRPO on Qwen2.5-7B with rule rewards (math answer accuracy + R1 format) on DeepScaleR or DAPO-Math-17k.
# Data:        bash examples/data/preprocess_data.sh deepscaler   (or math_17k)
# Weights:     bash examples/mcore/qwen25/ckpt_convert_qwen25_hf2mcore.sh
# Launch:      on every node: NNODES=2 NPUS_PER_NODE=8 MASTER_ADDR=<node0 ip> NODE_RANK=<0 on node0, 1 on node1> bash $0
# Resume:      automatic: --load equals --save (a fresh start when nothing is saved yet); SIGTERM saves first
# Memory:      per device (TP 4, DP 2), projected by benchmarks/memory.py from CPU measurements (see
#              benchmarks/README.md; `python benchmarks/memory.py --project-only runs/memory/memory.json`): rollout 36.2
#              GB (all 128 rows of a rank at once: KV cache 7.5 GB), forward passes 31.4 GB, update 42.9 GB, within the
#              56 GB target of a 64 GB device. The fused attention (the default) keeps no [s, s] tensor, so no
#              activation recompute is needed: the distributed optimizer (fp32 main weights and Adam moments over the 2
#              DP ranks: 12 instead of 18 B a parameter) and token-budget micro-batches of at most 4096 tokens (one
#              sample at the cap; short ones share a micro-batch) in the update, 32768 in the forward-only passes. Full
#              recompute (--recompute-granularity full --recompute-method uniform --recompute-num-layers 1) would take
#              the update to 29.4 GB at the price of a second forward in it; without the distributed optimizer the
#              update needs 54.3 GB, with --attention-backend local 64.5 GB.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source examples/mcore/launch_env.sh

TP=${TP:-4}; PP=${PP:-1}
REF_MODEL=${REF_MODEL:-./model_weights/qwen25_7b_mcore}
DATA_PATH=${DATA_PATH:-./dataset/deepscaler/data}
TOKENIZER=${TOKENIZER:-./model_from_hf/qwen25_7b}
CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./ckpt/qwen25_7b_grpo}

GPT_ARGS="--tensor-model-parallel-size $TP --pipeline-model-parallel-size $PP --use-distributed-optimizer \
  --micro-batch-size 1 --global-batch-size 32 --train-iters 1000 --bf16 \
  --max-tokens-per-micro-batch 4096 --forward-max-tokens-per-micro-batch 32768 \
  --lr 1e-6 --lr-decay-style constant --weight-decay 0.01 --clip-grad 1.0 \
  --adam-beta1 0.9 --adam-beta2 0.95 --seed 1234"
DATA_ARGS="--data-path $DATA_PATH --tokenizer-type PretrainedFromHF --tokenizer-name-or-path $TOKENIZER"
RL_ARGS="--stage grpo --ref-model $REF_MODEL --n-samples-per-prompt 8 \
  --max-prompt-length 2048 --max-new-tokens 2048 --max-length 4096 --do-sample --temperature 1.0 --top-p 1.0 \
  --kl-coef 0.001 --kl-penalty low_var_kl --clip-ratio 0.2 --entropy-coeff 0.0 --loss-agg-mode token-mean \
  --adv-scale group --ppo-epochs 1 --ppo-mini-batch-size 256 \
  --verifier-function math_acc format --verifier-weight 1.0 0.1"
OUTPUT_ARGS="--log-interval 1 --save $CKPT_SAVE_DIR --load $CKPT_SAVE_DIR --save-interval 50 --exit-signal-handler \
  --tensorboard-dir $CKPT_SAVE_DIR/tensorboard --metrics-jsonl $CKPT_SAVE_DIR/metrics.jsonl"

${PYTHON} -m torch.distributed.run $DISTRIBUTED_ARGS posttrain_gpt.py \
  $GPT_ARGS $DATA_ARGS $RL_ARGS $OUTPUT_ARGS "$@" | tee "${LOG_FILE:-logs_grpo_qwen25_7b.log}"
