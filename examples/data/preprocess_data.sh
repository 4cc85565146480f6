#!/usr/bin/env bash
# Preprocess a dataset described by configs/datasets/NAME.yaml with preprocess_data.py.
#
#   bash examples/data/preprocess_data.sh NAME [more preprocess_data.py flags]
#   e.g. INPUT=./deepscaler.json TOKENIZER=./Qwen2.5-7B OUTPUT_PREFIX=./dataset/deepscaler/data \
#        bash examples/data/preprocess_data.sh deepscaler --overwrite-cache
#
# Env overrides of the yaml: INPUT, TOKENIZER (or TOKENIZER_NAME_OR_PATH), OUTPUT_PREFIX, WORKERS,
# PROMPT_TYPE. PYTHON picks the interpreter (default: the repo's .venv/bin/python, else python).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
configs="$root/configs/datasets"
if [ $# -lt 1 ]; then
  echo "usage: bash examples/data/preprocess_data.sh NAME [flags]; NAME is one of:" \
       "$(cd "$configs" && ls *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')" >&2
  exit 2
fi
name="$1"; shift
cfg="$configs/$name.yaml"
if [ ! -f "$cfg" ]; then
  echo "error: no dataset config $cfg; available: $(cd "$configs" && ls *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')" >&2
  exit 2
fi
if [ -n "${PYTHON:-}" ]; then py="$PYTHON"
elif [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"
else py="python"; fi

args=(--config "$cfg")
[ -n "${INPUT:-}" ] && args+=(--input "$INPUT")
tok="${TOKENIZER:-${TOKENIZER_NAME_OR_PATH:-}}"
[ -n "$tok" ] && args+=(--tokenizer-name-or-path "$tok")
[ -n "${OUTPUT_PREFIX:-}" ] && args+=(--output-prefix "$OUTPUT_PREFIX")
[ -n "${WORKERS:-}" ] && args+=(--workers "$WORKERS")
[ -n "${PROMPT_TYPE:-}" ] && args+=(--prompt-type "$PROMPT_TYPE")

export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
exec "$py" "$root/preprocess_data.py" "${args[@]}" "$@"
