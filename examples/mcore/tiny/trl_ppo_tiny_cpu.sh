#!/usr/bin/env bash
# TRL-style PPO end to end on a laptop CPU in about a minute: a tiny random Llama with SmolLM2's tokenizer, rule
# reward + a critic initialised from the policy (value head converted with --orm), 2 iterations.
# Each command is printed before it runs; copy them as a template for your own runs.
set -euo pipefail
cd "$(dirname "$0")/../../.."
exec bash scripts/demo.sh --tiny --stage trl_ppo --out "${OUT:-runs/tiny_trl_ppo}" "$@"
