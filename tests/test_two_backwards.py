"""Several backwards or updates on one batch (tests/jobs/two_backwards.py, 3 real ranks; a blind DCGAN port's
findings): two losses backwarded from one forward train and are bit-identical after a kill in the step; a GAN's two
updates a batch, and its two networks under two DDPs with one optimizer, end the job at once, naming why.
"""

import subprocess
import sys

import pytest
from harness import REPO, env, verify_identical

from trainguard.errors import ConfigError
from trainguard.train.engine.batches import StepBatches, TWO_UPDATES

JOB = REPO / "tests" / "jobs" / "two_backwards.py"


def test_a_commit_that_took_no_batch_is_refused_only_once_the_training_loader_is_known():
    batches = StepBatches()
    batches.took(True)
    assert batches.commit(known=False) == 1
    assert batches.commit(known=False) == 1  # no training loader known yet: the position counts one, as before
    batches.took(True)
    assert batches.commit(known=True) == 1
    with pytest.raises(ConfigError) as exc:
        batches.commit(known=True)
    assert str(exc.value) == TWO_UPDATES
    batches.new_pass()  # a new pass began with no batch yet (the loop resumed at a pass's end)
    assert batches.commit(known=True) == 0


def test_two_losses_backwarded_from_one_forward_train_and_are_bit_identical_after_a_kill(tmp_path):
    verify_identical(tmp_path, JOB, "mid-step", ["--mode", "losses"], steps=12, workers=3)


def _run(mode: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", "3", "--hot-spares", "0", str(JOB), "--mode", mode]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)


def test_a_gans_two_updates_a_batch_end_the_job_at_once_naming_why():
    proc = _run("gan")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 78, out[-3000:]
    assert "optimizer.step() was called a second time on the same batch" in out, out[-3000:]


def test_two_networks_under_two_ddps_with_one_optimizer_are_told_to_share_one_module():
    proc = _run("two-ddp")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 78, out[-3000:]
    assert "the optimizer steps both, but trainguard holds one model: put the networks in one module" in out
