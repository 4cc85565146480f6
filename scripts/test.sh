#!/usr/bin/env bash
# The test command (README, .ci/run): sets up .venv when needed, then runs the whole suite on CPU.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/setup_venv.sh" | tail -n 1)"
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
set +e
"$py" -m pytest -q -p no:cacheprovider "$@" tests
rc=$?
set -e
# pytest exits 5 when no test was collected: that is a failure of the suite, not a pass.
if [ "$rc" -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit "$rc"
