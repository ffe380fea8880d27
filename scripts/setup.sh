#!/usr/bin/env bash
# Create .venv (if missing) and install trainguard with its dev extras.
# torch is pinned to 2.13.0 here (the CPU build); the package itself only asks for torch>=2.6.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
