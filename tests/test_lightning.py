"""PyTorch Lightning: examples/lightning/train.py is examples/lightning/train_plain.py, a plain Lightning script
(digits in a LightningDataModule with random shifts and noise drawn in `__getitem__` from torch's global generator,
a CNN with BatchNorm and dropout, SGD with momentum and a StepLR per epoch, a training loss logged on step and epoch
and validation metrics synced across ranks, ModelCheckpoint on the validation loss, LearningRateMonitor, a CSV
logger, `seed_everything`), changed in 2 lines: the import and the Trainer's strategy. 3 ranks, real processes:
`trainguard verify` kills rank 1 inside the first epoch's validation (the metric's all_reduce as the validation
ends), right after ModelCheckpoint saved that epoch's checkpoint and in the second epoch's steps; in a training step
(every test), and SIGTERM and the same command again (with the loader workers). Every tensor of
every rank's model, optimizer, scheduler and Lightning's bookkeeping (its loops'
progress, ModelCheckpoint's state, every rank's logged values) is `torch.equal` to the run without a fault, and rank
0 prints the same epoch lines (their training loss is the mean of every rank's accumulated values, the replacement's
included). Each verify run goes to step 24 (15 a epoch); two whole runs, with and without a kill in the last
validation, end with the same checkpoint. Gradient accumulation with a schedule per update, the augmentation drawn
in two loader workers, a job started from Lightning's own checkpoint, FSDP2 through Lightning's model-parallel
strategy (`--strategy fsdp`: the port's third line), what the strategy refuses, and the oldest Lightning the extra
accepts (2.4.0) have their own tests."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import REPO, changed_lines, env, rank0_lines, verify_identical

pytest.importorskip("lightning")
pytestmark = pytest.mark.timeout(400)

ORIGINAL, PORT = REPO / "examples" / "lightning" / "train_plain.py", REPO / "examples" / "lightning" / "train.py"
OLDEST = REPO / ".venv" / "lightning-oldest"  # scripts/setup.sh: the oldest version pyproject's extra accepts
WORKERS, EPOCHS, STEPS = 3, 2, 24
# rank 1's all_reduce calls: 7 before training (the sanity check's), one per step (the training loss logged on step),
# then 4 as the first epoch's validation ends (two metrics, each a value and a count): #23 is the first of those
IN_VALIDATION = "at:all_reduce:23"
# #30: right after ModelCheckpoint saved epoch 0's checkpoint (the run after the fault saves it again: Lightning's
# version counter named it `-v1`); #36: in epoch 1's steps (ModelCheckpoint's `current_score` was left None)
AFTER_SAVE, IN_EPOCH_1 = "at:all_reduce:30", "at:all_reduce:36"
LINE = re.compile(r"epoch \d+: (train|val)_.*")


def verify(tmp_path: Path, faults: str, *args: str, steps: int = STEPS, **extra: str) -> subprocess.CompletedProcess:
    return verify_identical(tmp_path, PORT, faults, ["--devices", str(WORKERS), "--epochs", str(EPOCHS), *args],
                            steps=steps, workers=WORKERS, **extra)


def test_the_port_changes_at_most_five_lines():
    changed, diff = changed_lines(ORIGINAL, PORT)
    assert 0 < changed <= 5, diff
    assert not re.search(r"^(import|from) trainguard", ORIGINAL.read_text(), re.M)  # the original is plain Lightning


def test_every_fault_is_bit_identical_on_every_rank_with_the_same_epoch_lines(tmp_path):
    proc = verify(tmp_path, f"{IN_VALIDATION},{AFTER_SAVE},{IN_EPOCH_1}")  # a kill in a step: every test below; at
    # an epoch's end: the accumulation and FSDP2 tests; SIGTERM and a rerun: the loader-workers test (suite time); the
    # scheduler's kill: framework-blind, tested with plain loops (test_seed_flow.py, test_recovery.py, test_pipeline.py)
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith(("kill -9", "SIGTERM"))]
    assert len(rows) == 3 and all(" identical" in r for r in rows), proc.stdout
    where = (tmp_path / "at-all_reduce-23" / "launcher.log").read_text()
    assert "rank 0: back to step 15 (CollectiveFailed: all_reduce" in where, where[-3000:]  # after the epoch's last
    reference = rank0_lines(tmp_path / "clean" / "launcher.log", LINE)
    assert [line.split(":")[1].split()[0] for line in reference] == ["val_loss", "train_loss"], reference  # epoch 0's
    for fault in ("at-all_reduce-23", "at-all_reduce-30", "at-all_reduce-36"):
        assert rank0_lines(tmp_path / fault / "launcher.log", LINE) == reference, fault


def test_a_checkpoint_callback_given_no_folder_keeps_the_first_runs_folder_after_a_fault(tmp_path):
    """The most copied shape of ModelCheckpoint: no `dirpath`, so Lightning places it under the logger's version
    folder, and the logger of each run of the script takes the next free version. After a kill, the callback's best
    models (and the files it keeps and deletes) must go on in the folder of the job's first run, as without a fault
    (verify once said: differs, `ModelCheckpoint ... best_k_models`)."""
    source = PORT.read_text()
    placed = 'ModelCheckpoint(dirpath=f"{args.out}/checkpoints", monitor="val_loss", save_last=True)'
    assert placed in source
    script = tmp_path / "train_no_dirpath.py"
    script.write_text(source.replace(placed, 'ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)'))
    keep = tmp_path / "runs"
    verify_identical(keep, script, "mid-step", ["--devices", str(WORKERS), "--epochs", "3", "--out", "out"],
                     steps=40, workers=WORKERS)
    saved = {name: sorted(str(p.relative_to(keep / name / "out")) for p in (keep / name / "out").rglob("*.ckpt"))
             for name in ("clean", "mid-step")}
    assert saved["clean"] == saved["mid-step"] and len(saved["clean"]) == 3, saved  # epochs 0 and 1, and last
    assert (keep / "mid-step" / "out" / "logs" / "version_1").is_dir()  # the logger itself took the next version


def test_a_kill_in_the_last_validation_ends_with_the_uninterrupted_checkpoint_and_lines(tmp_path):
    """Two whole runs to the end (2 epochs, 30 updates): without a fault, and with rank 1 killed in the last epoch's
    validation (its all_reduce #46: 7 before training, 15 a epoch's steps, 8 as an epoch ends). Lightning's own last
    checkpoint, written after that validation, holds the same model and optimizer tensors, and rank 0 the same lines."""
    runs = {}
    for name, fault in (("clean", ""), ("fault", "1:all_reduce:46")):
        folder = tmp_path / name
        folder.mkdir()
        with open(folder / "launcher.log", "w") as log:
            proc = subprocess.run([sys.executable, "-m", "trainguard", "run", "--workers", str(WORKERS),
                                   "--recovery-path", str(folder / "recovery"), str(PORT), "--devices", str(WORKERS),
                                   "--epochs", str(EPOCHS), "--out", str(folder / "out")], cwd=folder,
                                  env=env(TG_FAULT_COLLECTIVE=fault), stdout=log, stderr=subprocess.STDOUT, timeout=300)
        text = (folder / "launcher.log").read_text()
        assert proc.returncode == 0, text[-3000:]
        runs[name] = (text, torch.load(folder / "out" / "checkpoints" / "last.ckpt", weights_only=False))
    assert "rank 0: back to step 30 (CollectiveFailed: all_reduce" in runs["fault"][0], runs["fault"][0][-3000:]
    (_, clean), (_, fault) = runs["clean"], runs["fault"]
    assert clean["global_step"] == fault["global_step"] == 30
    assert clean["state_dict"].keys() == fault["state_dict"].keys()
    for key, tensor in clean["state_dict"].items():
        assert torch.equal(tensor, fault["state_dict"][key]), key
    moments = clean["optimizer_states"][0]["state"], fault["optimizer_states"][0]["state"]
    assert moments[0].keys() == moments[1].keys()
    for i, a in moments[0].items():
        assert all(torch.equal(a[k], moments[1][i][k]) for k in a), i
    assert clean["lr_schedulers"] == fault["lr_schedulers"]
    reference = rank0_lines(tmp_path / "clean" / "launcher.log", LINE)
    assert len(reference) == 4 and rank0_lines(tmp_path / "fault" / "launcher.log", LINE) == reference, reference


@pytest.mark.parametrize("case, cause", [("manual", "manual optimization"), ("stream", "has no length")])
def test_what_the_strategy_cannot_run_live_ends_at_once_naming_the_cause(tmp_path, case, cause):
    proc = subprocess.run([sys.executable, "-m", "trainguard", "run", "--workers", "2", "--hot-spares", "0",
                           "--recovery-path", str(tmp_path / "recovery"),
                           str(REPO / "tests" / "jobs" / "lightning_refused.py"), "--case", case],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 78, proc.stderr[-3000:]
    verdict = next(line for line in proc.stderr.splitlines() if line.startswith("trainguard: worker"))
    assert "ConfigError" in verdict and cause in verdict, verdict
    assert "restarting worker" not in proc.stderr, proc.stderr[-3000:]
