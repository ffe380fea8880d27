"""PyTorch Lightning, the rest of it (split from test_lightning.py, whose module docstring tells the port and the faults,
so that the two files run in parallel): gradient accumulation with a schedule per update, the augmentation drawn in
two loader workers, a job started from Lightning's own checkpoint, FSDP2 through Lightning's model-parallel strategy,
and the oldest Lightning the extra accepts."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from harness import REPO, env, rank0_lines

pytest.importorskip("lightning")
from test_lightning import LINE, OLDEST, PORT, WORKERS, verify  # noqa: E402

pytestmark = pytest.mark.timeout(400)


def test_fsdp2_through_the_model_parallel_strategy_recovers_bit_identically_in_one_generation(tmp_path):
    """`--strategy fsdp`: the model sharded with torch's `fully_shard` in `configure_model()`, under trainguard's
    `ModelParallelStrategy`. A kill in a step (one fault, for suite time): every rank's shards, its own
    BatchNorm statistics (FSDP2 leaves them per rank: a step cut short must not keep its forward's move), the
    optimizer and Lightning's bookkeeping equal the run without a fault, with the same epoch lines; and each fault is
    one recovery (the first replacement once met the survivors in another collective: torch's distributed state dict
    steps the optimizer to make its state, which ran Lightning's per-step exchange on the survivors alone)."""
    proc = verify(tmp_path, "mid-step", "--strategy", "fsdp")
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("kill -9")]
    assert len(rows) == 1 and all(" identical" in r for r in rows), proc.stdout
    reference = rank0_lines(tmp_path / "clean" / "launcher.log", LINE)
    for fault in ("mid-step",):
        log = (tmp_path / fault / "launcher.log").read_text()
        assert "recovery 1: rank 1" in log and "-> generation 2," in log and "recovery 2" not in log, log[-3000:]
        assert rank0_lines(tmp_path / fault / "launcher.log", LINE) == reference, fault


def test_gradient_accumulation_with_a_schedule_stepped_per_update(tmp_path):
    """15 batches an epoch, 2 an update: 8 updates, the last of one batch. The kill lands in that last update, whose
    restore does the 7th update's rest again (its OneCycleLR step): the schedule is stepped once, not twice."""
    proc = verify(tmp_path, "mid-step", "--grad_accum", "2", "--schedule", "step", steps=14)
    assert "at step 7, after its first training forward" in proc.stdout


def test_augmentation_drawn_in_two_loader_workers_is_bit_identical_after_a_kill_and_a_rerun(tmp_path):
    """`--num_workers 2`: the random shifts and noise are drawn in loader workers seeded when each pass's iterator is
    made, at the pass's first fetch, which a restore reads again: keyed (train/state/streams.py), the workers draw
    what they drew without the fault (before, the weights and the best checkpoints' record differed)."""
    verify(tmp_path, "mid-step,sigterm", "--num_workers", "2")
    assert "the training loader resumed at batch" in (tmp_path / "mid-step" / "launcher.log").read_text()
    reference = rank0_lines(tmp_path / "clean" / "launcher.log", LINE)
    for fault in ("mid-step", "sigterm"):
        assert rank0_lines(tmp_path / fault / "launcher.log", LINE) == reference, fault


def test_a_job_started_from_lightnings_own_checkpoint(tmp_path):
    """The job's first run resumes from Lightning's checkpoint of a first epoch (`ckpt_path`): Lightning sets its
    sampler's epoch after making the pass, and the pass is decided at its first batch, so a fault goes back to it."""
    first = tmp_path / "first"
    first.mkdir()
    proc = subprocess.run([sys.executable, "-m", "trainguard", "run", "--workers", str(WORKERS), "--hot-spares", "0",
                           "--recovery-path", str(first / "recovery"), str(PORT), "--devices", str(WORKERS),
                           "--epochs", "1", "--out", str(first / "out")], cwd=first, env=env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = first / "out" / "checkpoints" / "last.ckpt"
    verify(tmp_path / "verify", "mid-step", "--ckpt_path", str(ckpt), "--epochs", "3")


@pytest.mark.skipif(not OLDEST.is_dir(), reason="scripts/setup.sh installs the oldest accepted Lightning there")
def test_the_oldest_lightning_the_extra_accepts(tmp_path):
    oldest = {"PYTHONPATH": os.pathsep.join(filter(None, [str(OLDEST), os.environ.get("PYTHONPATH", "")]))}
    version = subprocess.run([sys.executable, "-c", "import lightning; print(lightning.__version__)"],
                             env=env(**oldest), capture_output=True, text=True, timeout=60).stdout.strip()
    floor = re.search(r'"lightning>=([0-9.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert version == floor, (version, floor)
    verify(tmp_path, "mid-step", **oldest)
