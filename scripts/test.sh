#!/usr/bin/env bash
# Set up, then run the test suite (real processes on loopback), three test files at a time (pytest-xdist;
# each file's tests stay on one worker, so a module's fixtures are made once). Most tests wait on real
# processes (a heartbeat timeout, a restart), so three files keep two cores busy.
#   bash scripts/test.sh           everything (CI runs this)
#   bash scripts/test.sh --fast    the fast tier: pure decisions, the wire, and a few real recoveries
# Other arguments go to pytest (for example -n 0 to run in one process, or a test file).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
args=(-n "${TG_TEST_WORKERS:-3}" --dist loadfile)
if [ "${1:-}" = "--fast" ]; then
  shift
  args+=(-m fast)
fi
exec .venv/bin/python -m pytest -q "${args[@]}" "$@"
