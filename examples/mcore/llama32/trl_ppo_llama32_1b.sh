#!/usr/bin/env bash
# TRL-style PPO on Llama-3.2-1B: actor + reference from --ref-model, critic + reward from --reward-model,
# all four models in one SPMD group of NPUS_PER_NODE x NNODES processes.
# Companions: ckpt_convert_llama32_hf2mcore.sh, ckpt_convert_llama32_orm_hf2mcore.sh,
# data_convert_llama32_trl_ppo.sh (run them first), ckpt_convert_llama32_mcore2hf.sh (after).
# Memory: per device (one node, DP 8), projected by benchmarks/memory.py from CPU measurements (benchmarks/README.md;
# `python benchmarks/memory.py --project-only runs/memory/memory.json`): rollout 23.8 GB, forward passes 23.9 GB, update
# 28.3 GB. The model state of the two trained 1.24B models dominates: the distributed optimizer (their fp32 main weights
# and Adam moments over the 8 DP ranks) takes it from 49.4 to 23.5 GB; micro-batches stay --micro-batch-size samples (a
# token budget would pad these few short samples more).
set -euo pipefail
cd "$(dirname "$0")/../../.."
source examples/mcore/launch_env.sh

TP=${TP:-1}; PP=${PP:-1}
REF_MODEL=${REF_MODEL:-./model_weights/llama32_1b_mcore}
REWARD_MODEL=${REWARD_MODEL:-./model_weights/llama32_1b_rm_mcore}
DATA_PATH=${DATA_PATH:-./dataset/llama32/alpaca}
TOKENIZER=${TOKENIZER:-./model_from_hf/llama32_1b_hf}
CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./ckpt/llama32_1b_trl_ppo}

GPT_ARGS="--tensor-model-parallel-size $TP --pipeline-model-parallel-size $PP --use-distributed-optimizer \
  --micro-batch-size 4 --global-batch-size 64 --train-iters 500 --bf16 \
  --lr 1e-6 --critic-lr 5e-6 --lr-decay-style constant --weight-decay 0.0 --clip-grad 1.0 \
  --adam-beta1 0.9 --adam-beta2 0.95 --seed 1234"
DATA_ARGS="--data-path $DATA_PATH --tokenizer-type PretrainedFromHF --tokenizer-name-or-path $TOKENIZER"
RL_ARGS="--stage trl_ppo --ref-model $REF_MODEL --reward-model $REWARD_MODEL \
  --max-length 384 --max-new-tokens 128 --do-sample --temperature 0.7 --top-p 1.0 \
  --kl-coef 0.05 --gamma 1.0 --lam 0.95 --clip-ratio 0.2 --cliprange-value 0.2 --vf-coef 0.1 \
  --ppo-epochs 1 --missing-eos-penalty 1.0"
OUTPUT_ARGS="--log-interval 1 --save $CKPT_SAVE_DIR --load $CKPT_SAVE_DIR --save-interval 50 --exit-signal-handler \
  --tensorboard-dir $CKPT_SAVE_DIR/tensorboard --metrics-jsonl $CKPT_SAVE_DIR/metrics.jsonl"

${PYTHON} -m torch.distributed.run $DISTRIBUTED_ARGS posttrain_gpt.py \
  $GPT_ARGS $DATA_ARGS $RL_ARGS $OUTPUT_ARGS "$@" | tee "${LOG_FILE:-logs_trl_ppo_llama32_1b.log}"
