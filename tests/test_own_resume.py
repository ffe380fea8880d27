"""A script that resumes from its own checkpoint and counts its steps itself (tests/jobs/own_resume_steps.py, the
shape of a blind DDPM port): the job counts its steps from the script's resume point, so a kill after the resume
comes back where the script's counter was, bit-identical, with the fault at the job's step as asked."""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness import REPO, env, verify_identical

JOB = REPO / "tests" / "jobs" / "own_resume_steps.py"
pytestmark = pytest.mark.timeout(400)


def test_a_kill_after_the_scripts_own_resume_comes_back_where_its_counter_was(tmp_path):
    saved = tmp_path / "own.pt"
    first = subprocess.run([sys.executable, "-m", "trainguard", "run", "--workers", "3", "--hot-spares", "0",
                            "--recovery-path", str(tmp_path / "first"), str(JOB), "--steps", "8", "--save",
                            str(saved)], cwd=REPO, env=env(), capture_output=True, text=True, timeout=200)
    assert first.returncode == 0 and saved.exists(), first.stderr[-3000:]
    proc = verify_identical(tmp_path / "verify", JOB, "mid-step", ["--load", str(saved), "--steps", "20"],
                            steps=20, workers=3)
    assert "at step 10," in proc.stdout, proc.stdout  # the job counts from the resume (8): step 10 is after it
    log = (tmp_path / "verify" / "mid-step" / "launcher.log").read_text()
    assert "resumed at step 10 (" in log and "[worker 0] step 12" in log, log[-3000:]  # the script's count goes on
