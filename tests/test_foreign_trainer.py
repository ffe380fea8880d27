"""A trainer someone else wrote for torchrun (tests/jobs/foreign_trainer.py), ported here as a user ports it, by
changing its imports and a few lines, and never edited for trainguard. Its state trainguard is not told of (a
`ReduceLROnPlateau`, an EMA) and its collectives outside the step (a validation every 5 steps with an all_reduce,
an all_gather_object and a broadcast_object_list) must survive kill -9 of each rank position, in a step and in a
validation's all_gather_object, with every tensor and value of model, EMA, optimizer and both schedulers equal to
an uninterrupted run's. The validation the kill interrupts comes after a step's update in the loop body, so the run
after resumes past it and its line never prints: the replay audit says so (warn here; exit 80 under strict). 3 ranks:
with 2, every summation order gives the same bits."""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import REPO, assert_identical, env

from trainguard.exitcodes import EXIT_CONFIG_ERROR

pytestmark = pytest.mark.timeout(300)

ORIGINAL = REPO / "tests" / "jobs" / "foreign_trainer.py"
PORT = (  # (what the script has, what the port has)
    ("from torch.nn.parallel import DistributedDataParallel as DDP\n"
     "from torch.utils.data import DataLoader, DistributedSampler, TensorDataset\n",
     "from torch.utils.data import TensorDataset\n\nimport trainguard as tg\n"
     "from trainguard import DDP, DataLoader, DistributedSampler\n"),
    ('dist.init_process_group("gloo")', "tg.init()"),
    ("    model = DDP(model)\n", "    model = DDP(model)\n    optimizer = tg.Optimizer(optimizer, lr_scheduler=warmup)\n"),
    ("global_step = 0", "global_step = tg.start_step()"),
    ("for epoch in range(args.epochs):", "for epoch in range(tg.start_epoch(), args.epochs):"),
)


def port(tmp: Path, replacements=PORT) -> Path:
    text = ORIGINAL.read_text()
    for was, now in replacements:
        assert text.count(was) == 1, was
        text = text.replace(was, now)
    path = tmp / "foreign_trainer_port.py"
    path.write_text(text)
    return path


def run(tmp: Path, name: str, script: Path, fault: str = "", at_collective: str = "",
        epochs: int = 2, exact: str = "strict") -> tuple[list[dict], dict, str]:
    out = tmp / name
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard", "run", "--workers", "3", "--hot-spares", "1", "--recovery-path",
         str(out / "recovery"), str(script), "--epochs", str(epochs), "--out", str(out / "final")],
        cwd=REPO, env=env(TG_FAULT=fault, TG_FAULT_COLLECTIVE=at_collective, TG_EXACT=exact), capture_output=True,
        text=True,
        timeout=240)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launcher.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not fault or proc.stdout.count("trainguard: recovery ") == len(fault.split(",")) + bool(at_collective)
    epochs = dict(re.findall(r"epoch (\d+) val (\S+ lr \S+)", proc.stdout))  # a validation done again prints again
    return [torch.load(out / "final" / f"rank_{r}.pt", weights_only=True) for r in range(3)], epochs, proc.stderr


def test_the_port_changes_few_lines(tmp_path):
    diff = [line for line in difflib.unified_diff(ORIGINAL.read_text().splitlines(), port(tmp_path).read_text()
                                                  .splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---")) and line[1:].strip()]
    assert len([line for line in diff if line.startswith("+")]) <= 7, diff


def test_a_foreign_trainer_with_state_it_does_not_give_survives_each_rank_killed(tmp_path):
    script = port(tmp_path)
    want, want_epochs, _ = run(tmp_path, "uninterrupted", script)
    assert sorted(want_epochs) == ["0", "1"]  # 27 steps an epoch
    # rank 1 in a step of epoch 0, rank 0 in the third validation, rank 2 in the last step but one of epoch 1
    got, epochs, log = run(tmp_path, "faulty", script, fault="1:12:kill,2:53:kill",
                           at_collective="0:all_gather_object:3", exact="warn")
    for r in range(3):
        assert_identical(got[r], want[r], f"rank {r}")
    assert epochs == want_epochs
    # that validation runs after step 15's update, in the loop body: the loop resumes at step 16, past it, so its line
    # never prints. The weights are the same, the output is not, and the replay audit says so (under strict: exit 80)
    launcher = (tmp_path / "faulty" / "launcher.log").read_text()
    assert "NOT bit-identical from step 15 (rank " in launcher and "the code after step 15's update" in launcher
    assert "step 15 val" in (tmp_path / "uninterrupted" / "launcher.log").read_text()
    assert "step 15 val" not in launcher
    assert want[0]["plateau"]["num_bad_epochs"] or want[0]["plateau"]["best"] < float("inf")  # it was stepped
    assert int(want[0]["ema"]["n_averaged"]) > 0
    assert "no trainguard.DataLoader drives its steps" not in log


def test_a_port_that_keeps_torchs_training_loader_is_told_at_the_first_restore(tmp_path):
    """The one port mistake trainguard cannot repair: torch's DataLoader restarts its epoch after a restore, so
    batches are trained twice. The job cannot tell it from an eval loader, so it says so loudly when it resumes,
    and the replay audit (warn) sees the replayed step train on another batch."""
    keeps_torchs = tuple((was, now.replace("DDP, DataLoader, DistributedSampler", "DDP\nfrom torch.utils.data import "
                                           "DataLoader, DistributedSampler")) for was, now in PORT
                         if "start_epoch" not in now)  # with it, the first step ends the job: below
    _, _, log = run(tmp_path, "torchs-loader", port(tmp_path, keeps_torchs), fault="1:12:kill", epochs=1,
                    exact="warn")
    assert ("warning: the job resumes at step 12, batch 12 of epoch 0, but no trainguard.DataLoader drives its "
            "steps, and the script has 2 torch.utils.data.DataLoaders" in log), log[-3000:]
    assert "batches 0-11 of epoch 0 are trained twice" in log and "Import DataLoader and DistributedSampler" in log
    assert "not bit-identical: the inputs of rank " in log and "at step 12 differ from its first run" in log


def test_a_port_that_keeps_torchs_training_loader_and_starts_its_loop_at_start_epoch_ends_at_its_first_step(tmp_path):
    """start_epoch() gives the epoch trainguard's loader has reached: with torch's, after a fault the loop would start
    at the first epoch again. The first step ends the job, exit 78, naming the fix (train/engine/guard.py)."""
    keeps_torchs = tuple((was, now.replace("DDP, DataLoader, DistributedSampler", "DDP\nfrom torch.utils.data import "
                                           "DataLoader, DistributedSampler")) for was, now in PORT)
    script = port(tmp_path, keeps_torchs)
    proc = subprocess.run([sys.executable, "-m", "trainguard", "run", "--workers", "3", "--hot-spares", "0",
                           "--recovery-path", str(tmp_path / "recovery"), str(script), "--epochs", "1", "--out",
                           str(tmp_path / "final")], cwd=REPO, env=env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no trainguard.DataLoader gave this step its batch" in proc.stdout + proc.stderr
