#!/usr/bin/env bash
# The test command (README, .ci/run): sets up .venv when needed, then runs the suite on CPU.
#   bash scripts/test.sh                  everything (tests/unit and tests/dist; what .ci/run runs)
#   bash scripts/test.sh --fast [ARGS]    the unit lane only (tests/unit: no process spawn, no model above a few MB)
#   bash scripts/test.sh ARGS             pytest ARGS over the whole suite (e.g. -m "not slow", -k NAME), or over
#                                         the test paths ARGS name (tests/unit/test_docs.py)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$root/scripts/setup_venv.sh" | tail -n 1)"
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# This checkout's package first, for the tests' child processes too: a venv shared between checkouts has its
# editable install pointing at another one.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
paths=(tests)
if [ "${1:-}" = "--fast" ]; then
  shift
  paths=(tests/unit)
fi
# test paths among the arguments replace the default ones (`bash scripts/test.sh tests/unit/test_docs.py`)
for arg in "$@"; do
  case "$arg" in tests|tests/*) paths=(); break ;; esac
done
set +e
"$py" -m pytest -q -p no:cacheprovider "$@" "${paths[@]}"
rc=$?
set -e
# pytest exits 5 when no test was collected: that is a failure of the suite, not a pass.
if [ "$rc" -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit "$rc"
