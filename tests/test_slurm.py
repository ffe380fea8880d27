"""Slurm, for real: examples/slurm/train.sbatch submitted with sbatch to the Slurm daemons that
scripts/slurm-up.sh starts (`.ci/run` does), preempted with `scancel --signal=TERM` while it trains:
the workers save a dying gasp and exit 75, the script requeues the job, and the requeued run resumes
and ends bit-identical to an uninterrupted run. Skipped, saying why, where no Slurm node is up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO, assert_identical, env, events, finals, job_args, wait_for

from trainguard.checkpoint import list_checkpoints


def _slurm_down() -> str:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "Slurm is not installed (scripts/slurm-up.sh installs and starts it)"
    try:
        states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sinfo failed: {exc}"
    if not any(s.strip() in ("idle", "mixed", "allocated") for s in states.splitlines()):
        return f"no Slurm node is up (sinfo says {states.strip()!r}); run scripts/slurm-up.sh as root"
    return ""


WHY = _slurm_down()
pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(bool(WHY), reason=WHY)]


@pytest.fixture
def baseline(baseline_runs):
    return baseline_runs(2)


def job_state(job_id: str) -> dict[str, str]:
    line = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                          timeout=20).stdout
    return dict(kv.split("=", 1) for kv in line.split() if "=" in kv)


def test_scancel_term_then_requeue_resumes_bit_identical(tmp_path, baseline):
    out = tmp_path
    script, *args = job_args(out, extra=("--ckpt", str(out / "ckpt"), "--save-steps", "4", "--dying-gasp",
                                         "callback", "--step-sleep", "0.05"))
    e = env(RECOVERY=str(out / "recovery"), WORKERS_PER_NODE="2", GRACE="10",
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    submit = subprocess.run(["sbatch", "--parsable", "--nodes=1", f"--chdir={out}", f"--output={out}/slurm-%j.out",
                             str(REPO / "examples" / "slurm" / "train.sbatch"), script, *args],
                            env=e, capture_output=True, text=True, timeout=30)
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]
    log = out / f"slurm-{job_id}.out"
    try:
        wait_for(lambda: any(c.step >= 4 for c in list_checkpoints(out / "ckpt", "job")), 120,
                 "training under Slurm to save a checkpoint")
        subprocess.run(["scancel", "--signal=TERM", job_id], check=True, timeout=20)  # to the job's steps
        # Slurm holds a requeued job until its old credential expires (scripts/slurm-up.sh: cred_expire=5)
        wait_for(lambda: job_state(job_id).get("JobState") == "COMPLETED", 150, "the requeued job to complete",
                 period=0.5)
    finally:
        if job_state(job_id).get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED", None):
            subprocess.run(["scancel", job_id], timeout=20)
    state = job_state(job_id)
    text = log.read_text() if log.exists() else ""
    assert state.get("ExitCode") == "0:0" and int(state.get("Restarts", "0")) >= 1, (state, text[-3000:])
    stops = [e for e in events(out) if e["event"] == "graceful_exit"]
    assert stops and all(e.get("saved") for e in stops), text[-3000:]  # the dying gasp on SIGTERM
    assert any(e["event"] == "restored" and e["source"] == "disk" for e in events(out))  # the requeued run
    got = finals(out, 2)
    for rank in range(2):
        assert_identical(got[rank], baseline[rank], f"rank {rank}")
