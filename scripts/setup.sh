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
# the oldest Accelerate that trainguard[accelerate] accepts, beside the pinned one: tests/test_accelerate.py runs it too
oldest=$(sed -n 's/^accelerate = \["accelerate>=\([0-9.]*\)"\].*/\1/p' pyproject.toml)
if [ -n "$oldest" ] && [ ! -f ".venv/accelerate-oldest/accelerate-$oldest.dist-info/METADATA" ]; then
  rm -rf .venv/accelerate-oldest
  .venv/bin/python -m pip install -q --no-deps --target .venv/accelerate-oldest "accelerate==$oldest" \
    || echo "accelerate==$oldest not installed; its test will be skipped"
fi
