#!/usr/bin/env bash
# GRPO on Qwen3-30B-A3B (mixture of experts: 48 layers, 128 experts, top-8) with rule rewards (math answer
# accuracy + R1 format) on DeepScaleR or DAPO-Math-17k. Default layout: 2 nodes x 8 devices, TP 1, PP 1,
# --expert-model-parallel-size 16, i.e. the experts of every MoE layer split over all 16 ranks (8 experts each; no
# expert data parallelism) and the dense weights (attention, embeddings: about 1.5B parameters) data-parallel over
# all 16.
# MindSpeed-RL's recipe runs TP 4 with --moe-tp-extend-ep instead; here a mixture of experts trains at TP 1 only
# (megatron-core trains MoE layers under tensor parallelism only with sequence parallelism, which the local layer
# spec does not have), so the experts are split by EP alone. Tokens reach their experts through the all-to-all
# dispatcher; --moe-routing-replay makes the training forwards route each response token to the experts the rollout
# chose, so the log-probabilities of the update and of the rollout come from the same experts (recompute replays
# them too).
#
# Memory: per device, projected by benchmarks/memory.py from CPU measurements (benchmarks/README.md; `python
# benchmarks/memory.py --project-only runs/memory/memory.json`): rollout 13.7 GB (all 16 rows of a rank at once),
# forward passes 18.2 GB, update 48.1 GB (43.0 GB of it model state: 8 experts x 48 layers at 18 B a parameter), within
# the 56 GB target of a 64 GB device. EP 8 does not fit: with every lever below its update needs 59.0 GB (53.9 GB of
# model state; EP 8 with PP 2 would fit, 43.1 GB, at the price of pipeline bubbles). At EP 16: full activation recompute
# (uniform, 1 layer), the distributed optimizer (the dense weights' main weights and moments over DP 16), the reference
# in host memory outside its pass (--offload-ref-reward), the actor's training state in host memory from one update to
# the next (--offload-train-*: it leaves room in the rollout and the forward passes), token-budget micro-batches of at
# most 4096 tokens in the update, 8192 in the forward-only passes. The fused attention (the default) keeps no [s, s]
# tensor (--attention-backend local: update 53.1 GB); without recompute the update needs 89.4 GB, without
# --offload-train-* the forward passes 54.5 GB.
#
# Before (paths are the defaults below):
#   data:    TOKENIZER=./model_from_hf/qwen3_30b_a3b OUTPUT_PREFIX=./dataset/deepscaler_qwen3/data \
#                bash examples/data/preprocess_data.sh deepscaler
#   weights: bash examples/mcore/qwen3_moe/ckpt_convert_qwen3_moe_hf2mcore.sh   (TP 1, PP 1, EP 16: convert with the
#            TP / PP / EP you launch with)
# Launch: the same command on every node, each with its own NODE_RANK (0 on the master node), with data,
# checkpoints, tokenizer and CKPT_SAVE_DIR at the same paths everywhere (CKPT_SAVE_DIR on a shared filesystem):
#   NODE_RANK=<0 or 1> MASTER_ADDR=<master node's address> bash examples/mcore/qwen3_moe/grpo_qwen3_30b_a3b.sh
# Other layouts: EP (a divisor of 128 whose multiple the world size is), PP, NNODES, NPUS_PER_NODE (see
# examples/mcore/launch_env.sh), e.g. NNODES=4 EP=16 (expert data parallel 2 shards the experts' optimizer state).
# NNODES=1 EP=8 (16 experts a rank, no expert data parallelism) does not fit a 64 GB device.
# Resume: automatic (--load equals --save; a fresh start when nothing is saved yet); SIGTERM saves first.
# After:   bash examples/mcore/qwen3_moe/ckpt_convert_qwen3_moe_mcore2hf.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
NNODES=${NNODES:-2}
source examples/mcore/launch_env.sh

TP=${TP:-1}; PP=${PP:-1}; EP=${EP:-16}
REF_MODEL=${REF_MODEL:-./model_weights/qwen3_30b_a3b_mcore}
DATA_PATH=${DATA_PATH:-./dataset/deepscaler_qwen3/data}
TOKENIZER=${TOKENIZER:-./model_from_hf/qwen3_30b_a3b}
CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./ckpt/qwen3_30b_a3b_grpo}

# Qwen3-30B-A3B, checked against every checkpoint the run loads (its config.json: head_dim 128, 4 key/value heads,
# q/k RMSNorms, rope_theta 1e6, intermediate_size 6144 (no dense layer uses it), moe_intermediate_size 768,
# norm_topk_prob true, router_aux_loss_coef 0.001).
MODEL_ARGS="--num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 32 --kv-channels 128 \
  --group-query-attention --num-query-groups 4 --padded-vocab-size 151936 --rotary-base 1000000 \
  --normalization RMSNorm --position-embedding-type rope --swiglu --disable-bias-linear --qk-layernorm \
  --untie-embeddings-and-output-weights \
  --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 768"
MOE_ARGS="--expert-model-parallel-size $EP --moe-grouped-gemm --moe-token-dispatcher-type alltoall \
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.001 --moe-routing-replay"
GPT_ARGS="--tensor-model-parallel-size $TP --pipeline-model-parallel-size $PP --use-distributed-optimizer \
  --micro-batch-size 1 --global-batch-size 32 --train-iters 1000 --bf16 \
  --max-tokens-per-micro-batch 4096 --forward-max-tokens-per-micro-batch 8192 \
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
  --offload-train-optimizer --offload-train-grad --offload-train-param \
  --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --clip-grad 1.0 \
  --adam-beta1 0.9 --adam-beta2 0.999 --seed 1234"
DATA_ARGS="--data-path $DATA_PATH --tokenizer-type PretrainedFromHF --tokenizer-name-or-path $TOKENIZER"
RL_ARGS="--stage grpo --ref-model $REF_MODEL --offload-ref-reward --n-samples-per-prompt 8 \
  --max-prompt-length 2048 --max-new-tokens 2048 --max-length 4096 --do-sample --temperature 1.0 --top-p 1.0 \
  --kl-coef 0.001 --kl-penalty low_var_kl --clip-ratio 0.2 --entropy-coeff 0.0 --loss-agg-mode token-mean \
  --adv-scale group --ppo-epochs 1 --ppo-mini-batch-size 256 \
  --verifier-function math_acc format --verifier-weight 1.0 0.1"
OUTPUT_ARGS="--log-interval 1 --save $CKPT_SAVE_DIR --load $CKPT_SAVE_DIR --save-interval 50 --exit-signal-handler \
  --tensorboard-dir $CKPT_SAVE_DIR/tensorboard --metrics-jsonl $CKPT_SAVE_DIR/metrics.jsonl"

${PYTHON} -m torch.distributed.run $DISTRIBUTED_ARGS posttrain_gpt.py \
  $MODEL_ARGS $MOE_ARGS $GPT_ARGS $DATA_ARGS $RL_ARGS $OUTPUT_ARGS "$@" | tee "${LOG_FILE:-logs_grpo_qwen3_30b_a3b.log}"
