"""Modules that training moves and trainguard does not hold (train/engine/unheld.py), on DINO's shape
(tests/jobs/dino.py): named at the run's start; registered as the message says, bit-identical after a kill."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from harness import REPO, env, verify_identical

from trainguard.train.engine import unheld

JOB = REPO / "tests" / "jobs" / "dino.py"
pytestmark = pytest.mark.timeout(300)


def test_a_teacher_and_a_loss_with_a_running_center_are_named_and_registered_they_recover_exactly(tmp_path):
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", "3", "--hot-spares", "0", "--recovery-path",
           str(tmp_path / "rec"), str(JOB), "--epochs", "1"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("trainguard: the module(s) 'teacher' (Sequential), 'loss_fn' (DINOLoss) changed between") == 1, \
        out[-3000:]
    assert "trainguard.register_state(name, module)" in out
    events = [json.loads(ln) for ln in (tmp_path / "rec" / "events.jsonl").read_text().splitlines()]
    assert [e["modules"] for e in events if e["event"] == "unheld_state"] == [["'teacher' (Sequential)",
                                                                              "'loss_fn' (DINOLoss)"]]
    proc = verify_identical(tmp_path / "verify", JOB, "mid-step", ["--register"], steps=20, workers=3)
    assert "module(s)" not in (tmp_path / "verify" / "clean" / "launcher.log").read_text()


def test_a_module_whose_tensors_the_held_state_shares_is_held():
    model, shadow = torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Sequential(torch.nn.Linear(2, 2))
    view = torch.nn.Linear(2, 2)
    view.weight, view.bias = model[0].weight, model[0].bias  # another module over the held tensors
    found = unheld.unheld_modules(model, {})
    assert not any(m is model or m is view for m in found)
    assert any(m is shadow for m in found) and not any(m is shadow[0] for m in found)  # named through its outermost
    assert not any(m is shadow for m in unheld.unheld_modules(model, {"ema": shadow}))  # registered: held
