#!/usr/bin/env bash
# Set up, then train a CNN on scikit-learn's digits with 2 workers through the launcher.
# Worker 1 is killed with SIGKILL after step 100; a hot spare takes its place, both ranks
# regroup and training continues from the same step, with bit-identical results.
# Then `trainguard report` prints that recovery phase by phase and draws the timeline picture.
# Set TG_FAULT= (empty) to train without the fault; TG_DEMO_DIR to keep the job's files elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TG_FAULT=${TG_FAULT-1:100:kill}
dir=${TG_DEMO_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/trainguard-demo-XXXXXX")}
.venv/bin/trainguard run --workers 2 --recovery-path "$dir/recovery" examples/digits.py "$@"
echo
.venv/bin/trainguard report "$dir/recovery" --plot "$dir/timeline.png"
