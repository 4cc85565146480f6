#!/usr/bin/env bash
# Prepares, on a networked CPU machine, what scripts/gpu_check.sh needs on the GPU machine (which has no
# network and lacks some packages; /work/shared/GPU_CHECK.md):
#
#   .whl/                 wheels (CPython 3.12, x86-64, no dependencies) of the packages missing from the GPU image
#   .cache/gpu_check/     tokenizer folders: SmolLM2's (the demo and benchmarks/vs_trl.py, as
#                         .cache/gpu_check/mindspeed_llm/smollm2-tokenizer, read through MINDSPEED_LLM_CACHE) and
#                         the offline Qwen2.5 one (the 0.5B-class Qwen2 runs)
#
# Both folders are git-ignored; the device tool takes them with `carry: [".whl", ".cache/gpu_check"]`.
# Re-running replaces the wheels (one version of each: two would stop the install) and keeps finished tokenizers.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi

# Pinned to what the project is tested with here (constraints.txt) and what GPU_CHECK.md lists.
WHEELS=(megatron-core==0.16.1 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
        trl==1.12.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0)

for path in .whl/x.whl .cache/gpu_check/x; do
  if ! git check-ignore -q "$path"; then
    echo "prepare_gpu_wheels: ${path%/x*}/ is not git-ignored; add it to .gitignore first" >&2
    exit 1
  fi
done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "==> downloading ${#WHEELS[@]} wheels for CPython 3.12 / manylinux x86-64"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$tmp" "${WHEELS[@]}"
mkdir -p .whl
rm -f .whl/*.whl
mv "$tmp"/*.whl .whl/

echo "==> tokenizer folders in .cache/gpu_check"
"$py" scripts/gpu_check.py prepare-assets --assets .cache/gpu_check

echo "==> what travels with carry"
ls -l .whl
du -sh .whl .cache/gpu_check
du -sc .whl .cache/gpu_check | tail -n 1 |
  awk '{printf "total %.1f MiB (with the repository, what travels must stay under 64 MiB)\n", $1 / 1024}'
