"""A survivor blocked in a collective with a peer that dies leaves it within 1 s of the detection, whatever
the collective (a 100 MB all_reduce, a barrier), and the job goes on: real processes, kill -9."""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness import REPO, env, events

pytestmark = pytest.mark.timeout(180)

JOB = REPO / "tests" / "jobs" / "stuck_collective.py"


def test_survivors_leave_a_large_all_reduce_and_a_barrier_within_a_second_of_the_detection(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "trainguard", "run", "--workers", "3", "--hot-spares", "1",
                           "--recovery-path", str(tmp_path / "recovery"), str(JOB), str(tmp_path)],
                          env=env(), capture_output=True, text=True, timeout=150)
    (tmp_path / "launcher.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ev = events(tmp_path)
    detected = {e["node"]: e["ts"] for e in ev if e["event"] == "failure_detected" and e.get("kind") != "collective"}
    assert set(detected) == {"2", "1"}, detected
    for run, dead, survivors in ((1, "2", ("0", "1")), (2, "1", ("0", "2"))):
        for node in survivors:
            left = float((tmp_path / f"left_{node}_{run}").read_text())
            assert left - detected[dead] < 1.0, f"run {run}: node {node} left {left - detected[dead]:.2f} s after"
    assert sum("run 3 passed" in line for line in proc.stdout.splitlines()) == 3
