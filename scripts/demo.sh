#!/usr/bin/env bash
# Set up, then train a CNN on scikit-learn's digits with 2 workers through the launcher.
# Worker 1 is killed with SIGKILL after step 100; a hot spare takes its place, both ranks
# regroup and training continues from the same step, with bit-identical results.
# Set TG_FAULT= (empty) to train without the fault.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TG_FAULT=${TG_FAULT-1:100:kill}
exec .venv/bin/trainguard run --workers 2 examples/digits.py "$@"
