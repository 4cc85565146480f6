#!/usr/bin/env bash
# TRL-style PPO (--stage trl_ppo) on Qwen2.5-32B over several nodes: by default 4 nodes x 8 devices, TP 8 x PP 4,
# i.e. one model replica (DP 1; 8 nodes give DP 2). The score is a rule reward (math answer accuracy, as
# MindSpeed-RL's PPO recipe); the critic starts from a Qwen2.5-32B reward model (value head), which does not score
# (--reward-model-weight 0, so it is loaded once, as the critic). Actor and reference come from --ref-model.
# Each prompt is sampled --n-samples-per-prompt times; every sample gets its own GAE. The optimizer state is sharded
# over the DP ranks (--use-distributed-optimizer; at DP 1 it is whole), and the actor's and critic's moments, grads and
# fp32 main weights, and the critic's weights, wait in host memory during the rollout (--offload-train-*).
#
# Before (paths below are the defaults; Qwen2.5 7B and 32B share one tokenizer, so a DeepScaleR set made for
# grpo_qwen25_7b.sh serves too):
#   data:    TOKENIZER=./model_from_hf/qwen25_32b bash examples/data/preprocess_data.sh deepscaler \
#                --max-prompt-length 2048
#   actor:   HF_DIR=./model_from_hf/qwen25_32b SAVE_DIR=./model_weights/qwen25_32b_mcore TP=8 PP=4 \
#                bash examples/mcore/qwen25/ckpt_convert_qwen25_hf2mcore.sh
#   critic:  bash examples/mcore/qwen25/ckpt_convert_qwen25_orm_hf2mcore.sh   (TP 8, PP 4 by default)
# Launch: the same command on every node, each with its own NODE_RANK (0 on the master node), with data,
# checkpoints, tokenizer and CKPT_SAVE_DIR at the same paths everywhere (CKPT_SAVE_DIR on a shared filesystem):
#   NODE_RANK=<0..3> MASTER_ADDR=<master node's address> bash examples/mcore/qwen25/ppo_qwen25_32b.sh
# Resume: automatic (--load equals --save; a fresh start when nothing is saved yet); SIGTERM saves first.
# Memory: per device (TP 8, PP 4: the first stage holds 4 micro-batches in flight under 1F1B), projected by
# benchmarks/memory.py from CPU measurements (benchmarks/README.md; `python benchmarks/memory.py --project-only
# runs/memory/memory.json`): rollout 17.9 GB (all 256 rows of a rank at once: KV cache 8.6 GB, the prefill of 64 prompts
# 7.2 GB; the training state waits in host memory), forward passes 8.7 GB, update 52.7 GB (21.5 GB of model state, 4
# micro-batches' activations of 7.6 GB each), within the 56 GB target of a 64 GB device. Full activation recompute of
# the first 3 of each stage's 16 layers (block) in the actor's and critic's update forwards, the reference model in host
# memory outside its pass (--offload-ref-reward), the actor's and critic's training state in host memory from one update
# to the next (--offload-train-*), token-budget micro-batches of at most 4096 tokens in the update (one sample at the
# cap; short ones share one), 32768 in the forward-only passes. The fused attention (the default) keeps no [s, s]
# tensor; recompute of every layer (uniform, 1) would take the update to 24.8 GB (at the price of a second forward of
# every layer), no recompute to 58.5 GB, without --offload-train-* the rollout to 54.4 GB and the update to 69.8 GB.
# After:   LOAD_DIR=./ckpt/qwen25_32b_trl_ppo/actor SAVE_DIR=./model_from_hf/qwen25_32b_trl_ppo_hf \
#              TOKENIZER_DIR=./model_from_hf/qwen25_32b bash examples/mcore/qwen25/ckpt_convert_qwen25_mcore2hf.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
NNODES=${NNODES:-4}
source examples/mcore/launch_env.sh

TP=${TP:-8}; PP=${PP:-4}
REF_MODEL=${REF_MODEL:-./model_weights/qwen25_32b_mcore}
CRITIC_MODEL=${CRITIC_MODEL:-./model_weights/qwen25_32b_rm_mcore}
DATA_PATH=${DATA_PATH:-./dataset/deepscaler/data}
TOKENIZER=${TOKENIZER:-./model_from_hf/qwen25_32b}
CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./ckpt/qwen25_32b_trl_ppo}

# Qwen2.5-32B, checked against every checkpoint the run loads (RMSNorm epsilon and the position limit come from
# its config.json: 1e-6 and 32768 for the Instruct model).
MODEL_ARGS="--num-layers 64 --hidden-size 5120 --ffn-hidden-size 27648 --num-attention-heads 40 \
  --group-query-attention --num-query-groups 8 --padded-vocab-size 152064 --rotary-base 1000000 \
  --normalization RMSNorm --position-embedding-type rope --swiglu --disable-bias-linear --add-qkv-bias \
  --untie-embeddings-and-output-weights"
GPT_ARGS="--tensor-model-parallel-size $TP --pipeline-model-parallel-size $PP --use-distributed-optimizer \
  --micro-batch-size 1 --global-batch-size 64 --train-iters 1000 --bf16 \
  --lr 1e-6 --critic-lr 5e-6 --lr-decay-style constant --weight-decay 0.01 --clip-grad 1.0 \
  --adam-beta1 0.9 --adam-beta2 0.95 --seed 1234 --offload-train-optimizer --offload-train-grad --offload-train-param \
  --recompute-granularity full --recompute-method block --recompute-num-layers 3 \
  --max-tokens-per-micro-batch 4096 --forward-max-tokens-per-micro-batch 32768"
DATA_ARGS="--data-path $DATA_PATH --tokenizer-type PretrainedFromHF --tokenizer-name-or-path $TOKENIZER"
RL_ARGS="--stage trl_ppo --ref-model $REF_MODEL --reward-model $CRITIC_MODEL --reward-model-weight 0 \
  --offload-ref-reward --verifier-function math_acc --verifier-weight 1.0 --n-samples-per-prompt 4 \
  --max-prompt-length 2048 --max-new-tokens 2048 --max-length 4096 --do-sample --temperature 1.0 --top-p 1.0 \
  --kl-coef 0.001 --kl-penalty k1 --gamma 1.0 --lam 0.95 --clip-ratio 0.2 --cliprange-value 0.5 --vf-coef 0.1 \
  --ppo-epochs 1"
OUTPUT_ARGS="--log-interval 1 --save $CKPT_SAVE_DIR --load $CKPT_SAVE_DIR --save-interval 50 --exit-signal-handler \
  --tensorboard-dir $CKPT_SAVE_DIR/tensorboard --metrics-jsonl $CKPT_SAVE_DIR/metrics.jsonl"

${PYTHON} -m torch.distributed.run $DISTRIBUTED_ARGS posttrain_gpt.py \
  $MODEL_ARGS $GPT_ARGS $DATA_ARGS $RL_ARGS $OUTPUT_ARGS "$@" | tee "${LOG_FILE:-logs_ppo_qwen25_32b.log}"
