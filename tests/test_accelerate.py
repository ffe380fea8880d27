"""Hugging Face Accelerate: examples/accelerate/train.py is examples/accelerate/train_plain.py, a plain Accelerate
script (digits with random shifts and noise drawn in `__getitem__` from torch's global generator, a model with
BatchNorm and dropout, `prepare`, `accumulate`, `clip_grad_norm_`, a OneCycleLR stepped per step,
`gather_for_metrics` in validation, `save_state` per epoch), changed in at most 3 lines. 3 ranks, real processes:
`trainguard verify` kills rank 1 in validation and right after an epoch's last step, and with the augmentation in
two loader workers in a step and by SIGTERM and the same command again; every tensor of every rank's model, optimizer, scheduler and loader
state is `torch.equal` to the run without a fault, and rank 0 prints the same validation lines (each run goes to
step 20 of 24, where verify takes the state). The oldest Accelerate the extra accepts (`trainguard[accelerate]`, installed by scripts/setup.sh beside the
pinned one) passes a kill in a step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import REPO, changed_lines, env, rank0_lines, verify_identical

pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(400)

ORIGINAL, PORT = REPO / "examples" / "accelerate" / "train_plain.py", REPO / "examples" / "accelerate" / "train.py"
OLDEST = REPO / ".venv" / "accelerate-oldest"  # scripts/setup.sh: the oldest version pyproject's extra accepts
WORKERS, EPOCHS, STEPS = 3, 3, 20
STEPS_PER_EPOCH = 8  # 1437 training images, 32 a batch on each of 3 ranks: 15 batches, 2 a step, the last alone
VAL = re.compile(r"epoch \d+: .*")


def verify(tmp_path: Path, faults: str, num_workers: str = "0", **extra: str) -> subprocess.CompletedProcess:
    return verify_identical(tmp_path, PORT, faults, ["--epochs", str(EPOCHS), "--num_workers", num_workers],
                            steps=STEPS, workers=WORKERS, **extra)


def validation(log: Path) -> list[str]:
    return rank0_lines(log, VAL)


def test_the_port_changes_at_most_three_lines():
    changed, diff = changed_lines(ORIGINAL, PORT)
    assert 0 < changed <= 3, diff
    assert not re.search(r"^(import|from) trainguard", ORIGINAL.read_text(), re.M)  # the original is plain Accelerate


def test_every_fault_is_bit_identical_on_every_rank_with_the_same_validation_lines(tmp_path):
    proc = verify(tmp_path, "outside,epoch-end")  # the scheduler's kill: framework-blind, tested with plain loops
    # (tests/test_seed_flow.py, tests/test_recovery.py, tests/test_pipeline.py); a kill in a step, and SIGTERM and a
    # rerun: below, with loader workers (suite time)
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith(("kill -9", "SIGTERM"))]
    names = [re.split(r"\s{2,}", r)[0] for r in rows]
    assert names == ["kill -9 outside a step (rank 1)", "kill -9 at an epoch's end (rank 1)"], proc.stdout
    assert all(" identical" in r for r in rows), proc.stdout
    outside = next(r for r in rows if r.startswith("kill -9 outside"))
    assert "all_gather" in outside, outside  # gather_for_metrics, in validation
    reference = validation(tmp_path / "clean" / "launcher.log")
    assert len(reference) == STEPS // STEPS_PER_EPOCH, reference  # the epochs that ended before the last step
    for fault in ("outside", "epoch-end"):
        assert validation(tmp_path / fault / "launcher.log") == reference, fault


@pytest.mark.skipif(not OLDEST.is_dir(), reason="scripts/setup.sh installs the oldest accepted Accelerate there")
def test_automatically_named_saves_go_on_with_the_jobs_count_after_a_fault(tmp_path):
    """`ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)` and `save_state()` with no folder, as
    Accelerate's docs show: each save is `checkpoint_<n>`, n counted by the Accelerator. A run of the script after a
    kill made a new Accelerator counting from 0, and Accelerate refused the existing `checkpoint_0` (the job ended
    with exit 78). The count is the job's now: the saves are those of the run without a fault, with the same tensors."""
    source = PORT.read_text()
    made = "accelerator = Accelerator(cpu=args.cpu, gradient_accumulation_steps=args.grad_accum)"
    saved = 'accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))'
    assert made in source and saved in source
    script = tmp_path / "train_named.py"
    script.write_text(source.replace(made, made[:-1] + ", project_config=ProjectConfiguration(project_dir="
                                     "args.output_dir, automatic_checkpoint_naming=True, total_limit=2))")
                      .replace(saved, "accelerator.save_state()")
                      .replace("import torch\n", "import torch\nfrom accelerate.utils import ProjectConfiguration\n", 1))
    keep = tmp_path / "runs"
    verify_identical(keep, script, "mid-step,sigterm", ["--epochs", "4", "--output_dir", "out"], steps=30,
                     workers=WORKERS)
    for fault in ("mid-step", "sigterm"):
        folders = sorted(p.name for p in (keep / fault / "out" / "checkpoints").iterdir())
        assert folders == sorted(p.name for p in (keep / "clean" / "out" / "checkpoints").iterdir()), fault
        assert folders == ["checkpoint_1", "checkpoint_2"], folders  # 3 saves by step 30; total_limit=2 dropped one
        for name in folders:
            clean, faulted = (torch.load(keep / run / "out" / "checkpoints" / name / "optimizer.bin") for run in
                              ("clean", fault))
            assert all(torch.equal(clean["state"][i][k], v) for i, state in faulted["state"].items()
                       for k, v in state.items() if isinstance(v, torch.Tensor)), (fault, name)


def test_augmentation_drawn_in_two_loader_workers_is_bit_identical_after_a_kill_and_a_rerun(tmp_path):
    """`--num_workers 2`: the training set's random shifts and noise are drawn in loader workers, whose streams torch
    seeds from the main process's when each pass's iterator is made. Accelerate makes it at the pass's first fetch,
    which a restore reads again from the pass's start: the fetch is keyed (train/state/streams.py), so the workers
    draw what they drew without the fault (before, the weights differed from the step after the kill)."""
    verify(tmp_path, "mid-step,sigterm", num_workers="2")
    assert "the training loader resumed at batch" in (tmp_path / "mid-step" / "launcher.log").read_text()
    reference = validation(tmp_path / "clean" / "launcher.log")
    assert len(reference) == STEPS // STEPS_PER_EPOCH, reference
    for fault in ("mid-step", "sigterm"):  # the validation lines too
        assert validation(tmp_path / fault / "launcher.log") == reference, fault


def test_the_oldest_accelerate_the_extra_accepts(tmp_path):
    oldest = {"PYTHONPATH": os.pathsep.join(filter(None, [str(OLDEST), os.environ.get("PYTHONPATH", "")]))}
    version = subprocess.run([sys.executable, "-c", "import accelerate; print(accelerate.__version__)"],
                             env=env(**oldest), capture_output=True, text=True, timeout=60).stdout.strip()
    floor = re.search(r'"accelerate>=([0-9.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert version == floor, (version, floor)
    verify(tmp_path, "mid-step", **oldest)


def test_step_checkpoints_named_by_the_scripts_batch_counter_are_those_of_the_run_without_a_fault(tmp_path):
    """Accelerate's complete examples count their batches in `overall_step`, which names and times their step saves
    (`--checkpointing_steps 6`). A blind port left it as it was: after a kill it counted from 0 again, and the saves
    came at other batches with other weights while the training stayed exact (verify, which compares the state, said
    identical). `start_batch(len(train_dataloader), overall_step)` gives it the job's count."""
    from safetensors.torch import load_file

    def run(out: Path, fault: str) -> set[str]:
        cmd = [sys.executable, "-m", "trainguard", "run", "--workers", str(WORKERS), "--recovery-path",
               str(out / "recovery"), str(PORT), "--epochs", "2", "--checkpointing_steps", "6", "--output_dir",
               str(out / "out")]
        proc = subprocess.run(cmd, cwd=REPO, env=env(TG_FAULT=fault), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return {p.name for p in (out / "out").iterdir() if p.name.startswith("step_")}

    clean, faulted = run(tmp_path / "clean", ""), run(tmp_path / "kill", "1:5:kill")
    assert clean == faulted == {"step_6", "step_12", "step_18", "step_24", "step_30"}, (clean, faulted)
    for name in sorted(clean):
        a, b = (load_file(tmp_path / run / "out" / name / "model.safetensors") for run in ("clean", "kill"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
