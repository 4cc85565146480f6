#!/usr/bin/env bash
# GRPO on DeepSeek-V3 / R1 (671B: 61 layers, multi-latent attention, 256 routed experts top-8 in 8 groups of which
# 4 are kept, one shared expert, layers 0-2 dense) with rule rewards (math answer accuracy + R1 format).
# Default layout: 8 nodes x 8 devices, TP 1, PP 1, --expert-model-parallel-size 64 (4 of the 256 experts of every
# MoE layer per rank); the dense part (MLA attention, the 3 dense MLPs, shared experts, embeddings: about 17B
# parameters) is data-parallel over all 64 ranks, its optimizer state sharded by --use-distributed-optimizer.
#
# Honest limits of this layout (read before launching):
# - NOT RUN at this size: the family is verified on tiny DeepSeek-V3 models (tests/dist/test_deepseek_v3.py: conversion
#   bit for bit at TP / PP / EP, transformers' logits at TP1, TP2, EP2, TP2 x EP2, PP2, greedy generation, packed
#   positions).
# - DOES NOT FIT a 64 or 80 GB device at this layout, by its model state alone (benchmarks/memory.py, which measures
#   the bytes per parameter of each part of the state but not multi-latent attention's activations; `python
#   benchmarks/memory.py --project-only runs/memory/memory.json`): a rank holds the 17.0B dense parameters and 4 experts
#   x 58 layers (10.2B), so the update needs at least 290 GB (the dense part at 2 + 4 + 12/64 B a parameter with the
#   distributed optimizer, the experts at 18 B: expert data parallelism is 1), 345 GB with the reference on the
#   device; with every offload (--offload-ref-reward, --offload-train-*) the rollout still holds 54.7 GB of weights
#   before its KV cache. No layout of what exists fits: PP is 1 (below), EP cannot exceed 64 on 64 ranks, and TP
#   for the dense part needs sequence parallelism for the MoE layers (below). More devices do not help the dense
#   part (17.0B x 6 B of bf16 weights and fp32 grads alone is 102 GB).
# - PP 1: 61 layers is prime and a pipeline stage here holds an equal share of the layers (MindSpeed-RL's uneven
#   9,10,10,10,11,11 split over PP 6 is not supported), so the only pipeline size is 1.
# - TP 1: megatron-core trains MoE layers under tensor parallelism only with sequence parallelism, which the local
#   layer spec does not have (MindSpeed-RL runs TP 4 with --moe-tp-extend-ep); experts are split by EP alone.
# - The released checkpoint is FP8 (weight_scale_inv tensors): convert_ckpt.py refuses it; dequantise to bf16 first
#   (DeepSeek-V3's inference/fp8_cast_bf16.py) and drop quantization_config from config.json. Its
#   multi-token-prediction layer 61 is skipped by the conversion (not trained, not exported).
# - The expert bias (e_score_correction_bias) is updated by megatron's aux-loss-free balancing during training
#   (--moe-router-bias-update-rate is megatron's default 1e-3), and the sequence aux loss uses coefficient 1e-4.
#
# Before:  data:    TOKENIZER=./model_from_hf/deepseek_v3_bf16 OUTPUT_PREFIX=./dataset/deepscaler_ds3/data \
#                       bash examples/data/preprocess_data.sh deepscaler
#          weights: bash examples/mcore/deepseek3/ckpt_convert_deepseek3_hf2mcore.sh   (same TP / PP / EP)
# Launch: the same command on every node, each with its own NODE_RANK (0 on the master node), data, checkpoints
# and CKPT_SAVE_DIR at the same paths everywhere:
#   NODE_RANK=<0..7> MASTER_ADDR=<master node's address> bash examples/mcore/deepseek3/grpo_deepseek3_671b.sh
# Other layouts: EP (a divisor of 256 whose multiple the world size is), NNODES, NPUS_PER_NODE.
# Resume: automatic (--load equals --save); SIGTERM saves first.
# After:   bash examples/mcore/deepseek3/ckpt_convert_deepseek3_mcore2hf.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
NNODES=${NNODES:-8}
source examples/mcore/launch_env.sh

TP=${TP:-1}; PP=${PP:-1}; EP=${EP:-64}
REF_MODEL=${REF_MODEL:-./model_weights/deepseek_v3_mcore}
DATA_PATH=${DATA_PATH:-./dataset/deepscaler_ds3/data}
TOKENIZER=${TOKENIZER:-./model_from_hf/deepseek_v3_bf16}
CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./ckpt/deepseek_v3_grpo}

# DeepSeek-V3, checked against every checkpoint the run loads (the MLA sizes, YaRN and routing come from the
# checkpoint's config: q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head_dim 128, YaRN factor 40,
# n_group 8, topk_group 4, routed_scaling_factor 2.5, first_k_dense_replace 3).
MODEL_ARGS="--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 \
  --padded-vocab-size 129280 --rotary-base 10000 --normalization RMSNorm --position-embedding-type rope --swiglu \
  --disable-bias-linear --untie-embeddings-and-output-weights \
  --num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048"
MOE_ARGS="--expert-model-parallel-size $EP --moe-grouped-gemm --moe-token-dispatcher-type alltoall \
  --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.0001 --moe-routing-replay"
GPT_ARGS="--tensor-model-parallel-size $TP --pipeline-model-parallel-size $PP --use-distributed-optimizer \
  --micro-batch-size 1 --global-batch-size 64 --train-iters 1000 --bf16 \
  --lr 1e-6 --lr-decay-style constant --weight-decay 0.0 --clip-grad 1.0 \
  --adam-beta1 0.9 --adam-beta2 0.95 --seed 1234"
DATA_ARGS="--data-path $DATA_PATH --tokenizer-type PretrainedFromHF --tokenizer-name-or-path $TOKENIZER"
RL_ARGS="--stage grpo --ref-model $REF_MODEL --n-samples-per-prompt 32 \
  --max-prompt-length 2048 --max-new-tokens 4096 --max-length 6144 --do-sample --temperature 1.0 --top-p 1.0 \
  --kl-coef 0.001 --kl-penalty low_var_kl --clip-ratio 0.2 --entropy-coeff 0.0 --loss-agg-mode token-mean \
  --adv-scale group --ppo-epochs 1 --ppo-mini-batch-size 2048 \
  --verifier-function math_acc format --verifier-weight 1.0 0.1"
OUTPUT_ARGS="--log-interval 1 --save $CKPT_SAVE_DIR --load $CKPT_SAVE_DIR --save-interval 20 --exit-signal-handler \
  --tensorboard-dir $CKPT_SAVE_DIR/tensorboard --metrics-jsonl $CKPT_SAVE_DIR/metrics.jsonl"

${PYTHON} -m torch.distributed.run $DISTRIBUTED_ARGS posttrain_gpt.py \
  $MODEL_ARGS $MOE_ARGS $GPT_ARGS $DATA_ARGS $RL_ARGS $OUTPUT_ARGS "$@" \
  | tee "${LOG_FILE:-logs_grpo_deepseek3_671b.log}"
