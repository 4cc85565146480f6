#!/usr/bin/env bash
# The NPU check in one command (docs/testing.md, "NPU"): the counterpart of scripts/gpu_check.sh for a machine with an
# Ascend NPU and torch_npu. It runs scripts/npu_check.py run (the fused attention and the fused norm / SwiGLU / RoPE
# against the plain-torch references of the CPU stand-in, the Triton-Ascend kernels where installed, both stages for 3
# bf16 iterations at a small shape, benchmarks/memory.py --device npu) and writes $OUT/npu_check.json (else
# runs/npu_check.json). Extra flags go to `npu_check.py run` (--steps, --skip, --budget, --dry-run, ...).
#
# Needs what gpu_check.sh needs on its machine (.cache/gpu_check/: the tokenizer folders, from
# `bash scripts/prepare_gpu_wheels.sh`), and torch_npu installed with the NPU's torch.
#
# Exit status: 0  every step that ran passed (steps left out for lack of time are listed as skipped)
#              1  a step failed or timed out (the JSON and the printed table say which, with its log's end)
#              3  no NPU here: prints "no NPU: nothing to check" and runs nothing (quick; nothing written)
# On a machine without an NPU the project's NPU branches are checked by the CPU stand-in instead
# (tests/dist/test_npu_lane.py): calls and documented semantics, not the hardware.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi

if ! command -v npu-smi >/dev/null 2>&1; then
  echo "no NPU: nothing to check (no npu-smi on this machine; run this on the Ascend machine)"
  exit 3
fi
if ! "$py" -c "import sys, torch, torch_npu; sys.exit(0 if torch.npu.is_available() and torch.npu.device_count() > 0 else 1)" >/dev/null 2>&1; then
  echo "no NPU: nothing to check (npu-smi is there, but $py's torch_npu is missing or sees no NPU)"
  exit 3
fi

export PYTHONUNBUFFERED=1
exec "$py" scripts/npu_check.py run "$@"
