"""Run a group of ranks of tests/jobs/sharded_job.py (one process importing torch, forking the ranks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "jobs" / "sharded_job.py"


def run_group(scenario: str, world: int, out: Path, timeout: float = 150) -> subprocess.CompletedProcess:
    """Run `scenario` on `world` gloo ranks writing under `out`; fail the test with the ranks' output."""
    out.mkdir(parents=True, exist_ok=True)
    store = out / f".store-{scenario}"
    store.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(JOB), scenario, str(world), str(store), str(out)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    (out / f"{scenario}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"{scenario} on {world} ranks failed:\n{(proc.stdout + proc.stderr)[-6000:]}"
    return proc
