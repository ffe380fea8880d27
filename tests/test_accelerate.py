"""Hugging Face Accelerate: examples/accelerate/train.py is examples/accelerate/train_plain.py, a plain Accelerate
script (digits, a model with BatchNorm and dropout, `prepare`, `accumulate`, `clip_grad_norm_`, a OneCycleLR stepped
per step, `gather_for_metrics` in validation, `save_state` per epoch), changed in at most 3 lines. 3 ranks, real
processes: `trainguard verify` kills rank 1 in a step, in validation, right after an epoch's last step, kills the
scheduler, and SIGTERMs then runs the same command again; every tensor of every rank's model,
optimizer, scheduler and loader state is `torch.equal` to the run without a fault, and rank 0 prints the same
validation lines (each run goes to step 20 of 24, where verify takes the state). The oldest Accelerate the extra accepts
(`trainguard[accelerate]`, installed by scripts/setup.sh beside the pinned one) passes a kill in a step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO, changed_lines, env, rank0_lines, verify_identical

pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(400)

ORIGINAL, PORT = REPO / "examples" / "accelerate" / "train_plain.py", REPO / "examples" / "accelerate" / "train.py"
OLDEST = REPO / ".venv" / "accelerate-oldest"  # scripts/setup.sh: the oldest version pyproject's extra accepts
WORKERS, EPOCHS, STEPS = 3, 3, 20
STEPS_PER_EPOCH = 8  # 1437 training images, 32 a batch on each of 3 ranks: 15 batches, 2 a step, the last alone
VAL = re.compile(r"epoch \d+: .*")


def verify(tmp_path: Path, faults: str, **extra: str) -> subprocess.CompletedProcess:
    return verify_identical(tmp_path, PORT, faults, ["--epochs", str(EPOCHS)], steps=STEPS, workers=WORKERS, **extra)


def validation(log: Path) -> list[str]:
    return rank0_lines(log, VAL)


def test_the_port_changes_at_most_three_lines():
    changed, diff = changed_lines(ORIGINAL, PORT)
    assert 0 < changed <= 3, diff
    assert not re.search(r"^(import|from) trainguard", ORIGINAL.read_text(), re.M)  # the original is plain Accelerate


def test_every_fault_is_bit_identical_on_every_rank_with_the_same_validation_lines(tmp_path):
    proc = verify(tmp_path, "mid-step,outside,epoch-end,scheduler,sigterm")
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith(("kill -9", "SIGTERM"))]
    names = [re.split(r"\s{2,}", r)[0] for r in rows]
    assert names == ["kill -9 in a step (rank 1)", "kill -9 outside a step (rank 1)", "kill -9 at an epoch's end (rank 1)",
                     "kill -9 of the scheduler", "SIGTERM and a rerun (rank 1)"], proc.stdout
    assert all(" identical" in r for r in rows), proc.stdout
    outside = next(r for r in rows if r.startswith("kill -9 outside"))
    assert "all_gather" in outside, outside  # gather_for_metrics, in validation
    assert "the training loader resumed at batch" in (tmp_path / "mid-step" / "launcher.log").read_text()
    reference = validation(tmp_path / "clean" / "launcher.log")
    assert len(reference) == STEPS // STEPS_PER_EPOCH, reference  # the epochs that ended before the last step
    for fault in ("mid-step", "outside", "epoch-end", "scheduler", "sigterm"):
        assert validation(tmp_path / fault / "launcher.log") == reference, fault


@pytest.mark.skipif(not OLDEST.is_dir(), reason="scripts/setup.sh installs the oldest accepted Accelerate there")
def test_the_oldest_accelerate_the_extra_accepts(tmp_path):
    oldest = {"PYTHONPATH": os.pathsep.join(filter(None, [str(OLDEST), os.environ.get("PYTHONPATH", "")]))}
    version = subprocess.run([sys.executable, "-c", "import accelerate; print(accelerate.__version__)"],
                             env=env(**oldest), capture_output=True, text=True, timeout=60).stdout.strip()
    floor = re.search(r'"accelerate>=([0-9.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert version == floor, (version, floor)
    verify(tmp_path, "mid-step", **oldest)
