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
# the oldest transformers that trainguard[transformers] accepts, with the hub and tokenizers it asks for (the venv has
# the newer ones the pinned transformers asks for): tests/test_transformers.py runs it too
toldest=$(sed -n 's/^transformers = \["transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml)
if [ -n "$toldest" ] && [ ! -f ".venv/transformers-oldest/transformers-$toldest.dist-info/METADATA" ]; then
  rm -rf .venv/transformers-oldest
  .venv/bin/python -m pip install -q --no-deps --target .venv/transformers-oldest "transformers==$toldest" \
    "tokenizers==0.22.2" "huggingface-hub==1.3.7" "httpx==0.28.1" "httpcore==1.0.9" "h11==0.16.0" "anyio==4.16.0" \
    "certifi" "idna" "sniffio==1.3.1" \
    || echo "transformers==$toldest not installed; its test will be skipped"
fi
# the oldest Lightning that trainguard[lightning] accepts, beside the pinned one: tests/test_lightning.py runs it too
loldest=$(sed -n 's/^lightning = \["lightning>=\([0-9.]*\)"\].*/\1/p' pyproject.toml)
if [ -n "$loldest" ] && [ ! -f ".venv/lightning-oldest/lightning-$loldest.dist-info/METADATA" ]; then
  rm -rf .venv/lightning-oldest
  .venv/bin/python -m pip install -q --no-deps --target .venv/lightning-oldest "lightning==$loldest" \
    || echo "lightning==$loldest not installed; its test will be skipped"
fi
