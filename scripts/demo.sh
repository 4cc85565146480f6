#!/usr/bin/env bash
# The main job on the embedded default (README): sets up .venv when needed, then runs the demo pipeline
# (SmolLM2-135M-Instruct, offline arithmetic task, GRPO, before/after accuracy). Extra flags go to
# `python -m mindspeed_llm.demo.run` (e.g. --stage trl_ppo, --tiny, --iterations N; see --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/setup_venv.sh" | tail -n 1)"
cd "$root"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$py" -m mindspeed_llm.demo.run "$@"
