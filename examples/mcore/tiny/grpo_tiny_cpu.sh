#!/usr/bin/env bash
# GRPO end to end on a laptop CPU in about a minute: a tiny random Llama with SmolLM2's tokenizer, 2 iterations,
# through the real entry points (preprocess_data.py, convert_ckpt.py, torchrun posttrain_gpt.py, convert back).
# Each command is printed before it runs; copy them as a template for your own runs.
# For the real model (SmolLM2-135M-Instruct, ~10 minutes): bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
exec bash scripts/demo.sh --tiny --stage grpo --out "${OUT:-runs/tiny_grpo}" "$@"
