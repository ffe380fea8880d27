"""Every process of a job killed at once (the launcher's whole process group, kill -9: a lost host, an OOM killer),
then the same command again. Nothing holds the job's state (no checkpoint directory): the rerun must say so and not
start over. Before, the scheduler kept the job's step only in memory, so the rerun took it for a fresh job, trained
from step 0 and ended "resumed at step 0, lost 0 steps" (a blind port of torchvision's classification reference)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
from harness import REPO, env

JOB = REPO / "tests" / "jobs" / "own_resume_steps.py"
pytestmark = pytest.mark.timeout(240)


def committed(recovery) -> int:
    """The job's step as cluster.db keeps it (0 until written)."""
    try:
        with sqlite3.connect(f"file:{recovery / 'cluster.db'}?mode=ro", uri=True) as db:
            row = db.execute("SELECT value FROM meta WHERE key = 'committed'").fetchone()
    except sqlite3.Error:
        return 0
    return int(row[0]) if row else 0


def test_a_rerun_after_every_process_died_says_nothing_holds_the_state_instead_of_starting_over(tmp_path):
    recovery = tmp_path / "recovery"
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", "2", "--hot-spares", "0", "--recovery-path",
           str(recovery), str(JOB), "--steps", "100000"]
    with open(tmp_path / "first.log", "w") as log:
        job = subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
        deadline = time.monotonic() + 120
        while committed(recovery) == 0 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
    assert committed(recovery) > 0, (tmp_path / "first.log").read_text()[-3000:]
    time.sleep(1)  # the group's last processes reaped
    rerun = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=180)
    out = rerun.stdout + rerun.stderr
    assert rerun.returncode != 0, out[-4000:]
    assert "every rank lost its live state (the job had committed" in out, out[-4000:]
    assert "run it with a new --recovery-path" in out and "resumed at step 0" not in out, out[-4000:]
