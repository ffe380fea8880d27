"""A framework whose own loop trainguard does not run live as the script wrote it ends the job at once, naming it and
what to do instead (frameworks.py): a plain PyTorch Lightning script (strategy="ddp") under `trainguard run`
fails inside Lightning on every rank (`IndexError` in its DDP strategy) and used to restart into a crash loop with no
word of why; the message names trainguard's strategy. With that strategy loaded, Lightning is not refused. A script
that runs unported (its Lightning devices match the job, or torch's own DDP) is told at its first step that it is not
protected."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO, env

from trainguard.frameworks import unguarded, unsupported_framework

pytestmark = pytest.mark.timeout(400)


def test_the_framework_is_told_by_the_modules_loaded():
    assert unsupported_framework({"torch", "lightning.pytorch.trainer.trainer"}) == "PyTorch Lightning's Trainer"
    assert unsupported_framework({"pytorch_lightning.trainer.trainer"}) == "PyTorch Lightning's Trainer"
    assert unsupported_framework({"lightning.fabric.fabric"}) == "Lightning Fabric"
    assert unsupported_framework({"torch", "lightning.fabric.utilities.seed"}) is None  # a utility alone is no loop
    assert unsupported_framework({"torch", "accelerate"}) is None
    with_strategy = {"lightning.pytorch.trainer.trainer", "lightning.fabric.fabric", "trainguard.compat.lightning"}
    assert unsupported_framework(with_strategy) is None


def test_a_plain_lightning_script_ends_at_once_naming_lightning(tmp_path):
    pytest.importorskip("lightning")
    proc = subprocess.run([sys.executable, "-m", "trainguard", "run", "--workers", "2", "--hot-spares", "0",
                           "--recovery-path", str(tmp_path / "recovery"), str(REPO / "examples" / "lightning" / "train_plain.py")],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 78, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()
    verdict = next(line for line in last if line.startswith("trainguard: worker"))
    assert "PyTorch Lightning's Trainer" in verdict and "trainguard.compat.lightning.Strategy()" in verdict, verdict
    assert "restarting worker" not in proc.stderr, proc.stderr[-3000:]  # no crash loop


def test_the_unprotected_warning_names_the_port():
    lightning = unguarded({"torch", "lightning.pytorch.trainer.trainer"})
    assert "not protected" in lightning and "trainguard.compat.lightning.Strategy()" in lightning
    plain = unguarded({"torch", "torch.distributed"})
    assert "not protected" in plain and "trainguard.DDP" in plain and "trainguard.Optimizer" in plain


def _run(tmp_path, script: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "trainguard", "run", "--workers", "2", "--hot-spares", "0",
                           "--recovery-path", str(tmp_path / "recovery"), str(script), *args],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_an_unported_script_that_runs_is_told_it_is_not_protected(tmp_path):
    """torch's own DDP and optimizer under `trainguard run` (the tutorial's torchrun original) train, unprotected:
    rank 0 says so once, at the first step, naming the port; the port itself is not told."""
    proc = _run(tmp_path, REPO / "examples" / "ddp_tutorial_torchrun.py", "--total-epochs", "1",
                "--snapshot-path", str(tmp_path / "snapshot.pt"))
    assert proc.stderr.count("trainguard: WARNING: the script's optimizer stepped") == 1, proc.stderr[-3000:]
    assert "trainguard.DDP" in proc.stderr
    ported = _run(tmp_path, REPO / "examples" / "ddp_tutorial.py", "--total-epochs", "1",
                  "--snapshot-path", str(tmp_path / "snapshot2.pt"))
    assert "WARNING: the script's optimizer" not in ported.stderr, ported.stderr[-3000:]


def test_a_wrapped_optimizer_stepped_by_torchs_state_dict_helpers_before_the_loop_is_not_called_unprotected(tmp_path):
    """A blind FSDP2 port read its optimizer's state with torch's helpers before the loop, which step an optimizer
    with no state once at LR 0: the warning took that for an unported script's step, on every fresh job."""
    proc = _run(tmp_path, REPO / "tests" / "jobs" / "dsd_prestep.py")
    assert "WARNING: the script's optimizer" not in proc.stderr, proc.stderr[-3000:]


def test_a_plain_lightning_script_that_runs_is_told_it_is_not_protected(tmp_path):
    """Its devices match the job's workers, so Lightning does not crash: it trains unprotected, and rank 0 says so,
    naming trainguard's strategy; with the strategy, nothing is said."""
    pytest.importorskip("lightning")
    args = ("--devices", "2", "--epochs", "1", "--out", str(tmp_path / "out"))
    proc = _run(tmp_path, REPO / "examples" / "lightning" / "train_plain.py", *args)
    warning = [line for line in proc.stderr.splitlines() if "WARNING: the script's optimizer stepped" in line]
    assert len(warning) == 1 and "trainguard.compat.lightning.Strategy()" in warning[0], proc.stderr[-3000:]
    ported = _run(tmp_path, REPO / "examples" / "lightning" / "train.py", *args)
    assert "WARNING: the script's optimizer" not in ported.stderr, ported.stderr[-3000:]
