"""A framework whose own loop trainguard does not run live as the script wrote it ends the job at once, naming it and
what to do instead (launch/frameworks.py): a plain PyTorch Lightning script (strategy="ddp") under `trainguard run`
fails inside Lightning on every rank (`IndexError` in its DDP strategy) and used to restart into a crash loop with no
word of why; the message names trainguard's strategy. With that strategy loaded, Lightning is not refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness import REPO, env

from trainguard.launch.frameworks import unsupported_framework

pytestmark = pytest.mark.timeout(200)


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
