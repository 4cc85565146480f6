#!/usr/bin/env bash
# GRPO on a tiny random mixture of experts (Qwen3-MoE: 2 layers, 8 experts, top-2) on a laptop CPU with expert
# parallelism: 2 gloo processes, --expert-model-parallel-size 2, i.e. each process holds 4 of the 8 experts of
# every MoE layer and the dense weights are data-parallel (DP 2). Through the real entry points: the tiny model
# (tiny_moe_model.py, SmolLM2's tokenizer), the demo's arithmetic task, preprocess_data.py, convert_ckpt.py at EP 2,
# torchrun posttrain_gpt.py (all-to-all token dispatcher, routing replay), convert_ckpt.py back to Hugging Face.
# Each command is printed before it runs; copy them as a template for a real MoE run
# (examples/mcore/qwen3_moe/grpo_qwen3_30b_a3b.sh is the full-size one).
#   bash examples/mcore/tiny/grpo_tiny_moe_cpu.sh [more posttrain_gpt.py flags]
# OUT (default runs/tiny_grpo_moe) holds everything; the model, data and conversion are reused when present.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PYTHON=${PYTHON:-$(bash scripts/setup_venv.sh | tail -n 1)}
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
OUT=${OUT:-runs/tiny_grpo_moe}
NPROC=2; EP=2
MASTER_PORT=${MASTER_PORT:-29561}
run() { echo "+ $*" >&2; "$@"; }

echo "==> tiny random Qwen3-MoE (8 experts, top-2) with SmolLM2's tokenizer" >&2
[ -f "$OUT/hf_model/config.json" ] || run ${PYTHON} examples/mcore/tiny/tiny_moe_model.py "$OUT/hf_model"

echo "==> the arithmetic task (DeepScaleR rows) and preprocess_data.py" >&2
[ -f "$OUT/task/train.json" ] || run ${PYTHON} -m mindspeed_llm.demo.task "$OUT/task" --n-test 4
[ -f "$OUT/data/train_meta.json" ] || run ${PYTHON} preprocess_data.py --input "$OUT/task/train.json" \
  --tokenizer-type PretrainedFromHF --tokenizer-name-or-path "$OUT/hf_model" --output-prefix "$OUT/data/train" \
  --handler-name R1AlpacaStyleInstructionHandler --prompt-type chatml \
  --map-keys '{"prompt": "problem", "labels": "answer"}' --log-interval 0

echo "==> convert to Megatron at the run's layout: TP 1, PP 1, expert parallel $EP" >&2
[ -f "$OUT/mg_model/latest_checkpointed_iteration.txt" ] || run ${PYTHON} convert_ckpt.py \
  --load-model-type hf --save-model-type mg --load-dir "$OUT/hf_model" --save-dir "$OUT/mg_model" \
  --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1 --target-expert-parallel-size $EP --no-progress

echo "==> posttrain_gpt.py --stage grpo on $NPROC processes, --expert-model-parallel-size $EP" >&2
rm -rf "$OUT/ckpt"  # a fresh run each time (--load would resume it)
run ${PYTHON} -m torch.distributed.run --nproc_per_node $NPROC --master_addr 127.0.0.1 --master_port "$MASTER_PORT" \
  posttrain_gpt.py --stage grpo --ref-model "$OUT/mg_model" \
  --data-path "$OUT/data/train" --tokenizer-name-or-path "$OUT/hf_model" \
  --expert-model-parallel-size $EP --moe-token-dispatcher-type alltoall --moe-routing-replay \
  --micro-batch-size 2 --global-batch-size 2 --train-iters 2 --n-samples-per-prompt 2 \
  --lr 1e-4 --lr-decay-style constant --clip-grad 1.0 --adam-beta2 0.99 --seed 1234 \
  --do-sample --temperature 1.0 --kl-coef 0.001 --kl-penalty low_var_kl \
  --max-new-tokens 8 --max-length 192 --stop-token-ids 198,1116 --verifier-function first_line_answer \
  --log-interval 1 --metrics-jsonl "$OUT/metrics.jsonl" --save "$OUT/ckpt" --save-interval 2 "$@"

echo "==> convert the trained actor back to Hugging Face (every expert-parallel shard gathered)" >&2
rm -rf "$OUT/hf_trained"
run ${PYTHON} convert_ckpt.py --load-model-type mg --save-model-type hf --load-dir "$OUT/ckpt/actor" \
  --save-dir "$OUT/hf_trained" --tokenizer-dir "$OUT/hf_model" --no-progress

echo "==> done: metrics $OUT/metrics.jsonl, trained model $OUT/hf_trained (Qwen3MoeForCausalLM)" >&2
