#!/usr/bin/env bash
# The GPU check in one command (benchmarks/README.md, "GPU check"): on a machine with a CUDA GPU it runs
# scripts/gpu_check.py run (the tiny demo pipeline for both stages, 3 bf16 iterations of each stage on a random
# 0.5B-class Qwen2, benchmarks/vs_trl.py and benchmarks/logprobs.py on CUDA; about 8 minutes on one H200) and
# writes $OUT/gpu_check.json (else runs/gpu_check.json). Extra flags go to `gpu_check.py run` (--steps, --skip,
# --budget, --dry-run, ...).
#
# Needs, made on the CPU machine by `bash scripts/prepare_gpu_wheels.sh` and carried: .whl/ (wheels of the packages
# the GPU image lacks, installed into a temporary site folder when megatron-core is missing) and .cache/gpu_check/
# (tokenizer folders).
#
# Exit status: 0  every step that ran passed (steps left out for lack of time are listed as skipped)
#              1  a step failed or timed out (the JSON and the printed table say which, with its log's end)
#              3  no GPU here: prints "no GPU: nothing to check" and runs nothing (quick; nothing written)
# GPU_CHECK_ALLOW_CPU=1 runs the steps without a GPU anyway (with `--device cpu`: toy sizes, a check of the
# command lines on a CPU machine).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi

if [ "${GPU_CHECK_ALLOW_CPU:-0}" != "1" ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "no GPU: nothing to check (no nvidia-smi on this machine; run this on the GPU machine)"
    exit 3
  fi
  if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    echo "no GPU: nothing to check (nvidia-smi is there, but $py's torch sees no CUDA device)"
    exit 3
  fi
fi

export PYTHONUNBUFFERED=1
exec "$py" scripts/gpu_check.py run "$@"
