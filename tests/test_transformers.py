"""The transformers Trainer: examples/transformers/train.py is examples/transformers/train_plain.py, a plain
`Trainer` script (digits as a dataset of dicts, a model with BatchNorm and dropout that returns its loss, gradient
accumulation, clipping, a linear schedule with warm-up stepped per step, an accuracy metric evaluated every epoch,
the Trainer's own checkpoints), changed in its import. 3 ranks, real processes: `trainguard verify` kills rank 1 in
the Trainer's log all-gather after a step, right after an epoch's last step (before its evaluation), and SIGTERMs
then runs the same command again (a kill in a step: the oldest-version, MLM and GLUE tests; the scheduler's kill is
framework-blind: test_seed_flow.py, test_recovery.py); every tensor of every rank's model, optimizer, scheduler and the Trainer's bookkeeping (its state with the log history,
the loss sums of every rank) is equal to the run without a fault, and rank 0 prints the same validation lines (each
run goes to step 20 of 30, where verify takes the state). The oldest transformers the extra accepts
(`trainguard[transformers]`, installed by scripts/setup.sh beside the pinned one) passes a kill in a step. A
masked-language-model trainer written blind (tests/jobs/hf_mlm.py, masks drawn in two loader workers) is identical
after a kill."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO, changed_lines, env, rank0_lines, verify_identical

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(400)

ORIGINAL, PORT = REPO / "examples" / "transformers" / "train_plain.py", REPO / "examples" / "transformers" / "train.py"
OLDEST = REPO / ".venv" / "transformers-oldest"  # scripts/setup.sh: the oldest version pyproject's extra accepts
WORKERS, EPOCHS, STEPS = 3, 2, 20
STEPS_PER_EPOCH = 15  # 1437 training images, 16 a batch on each of 3 ranks: 30 batches, 2 a step
VAL = re.compile(r"validation epoch .*")


def verify(tmp_path: Path, faults: str, **extra: str) -> subprocess.CompletedProcess:
    return verify_identical(tmp_path, PORT, faults, ["--epochs", str(EPOCHS), "--output_dir", "out"], steps=STEPS, workers=WORKERS, **extra)


def validation(log: Path) -> list[str]:
    return rank0_lines(log, VAL)


def test_measured_values_are_kept_apart_and_put_back():
    from trainguard.compat.transformers import join_clock, split_clock

    history = [{"loss": 1.5, "step": 5}, {"eval_loss": 1.2, "eval_runtime": 0.08, "eval_samples_per_second": 4402.4,
                                         "eval_steps_per_second": 48.9, "step": 15}]
    kept, clock = split_clock(history)
    assert kept == [{"loss": 1.5, "step": 5}, {"eval_loss": 1.2, "step": 15}]
    assert sorted(k for _, k, _ in clock) == ["eval_runtime", "eval_samples_per_second", "eval_steps_per_second"]
    assert join_clock(kept, clock) == history


def test_the_port_changes_at_most_three_lines():
    changed, diff = changed_lines(ORIGINAL, PORT)
    assert 0 < changed <= 3, diff
    assert not re.search(r"^(import|from) trainguard", ORIGINAL.read_text(), re.M)  # the original is plain transformers


def test_every_fault_is_bit_identical_on_every_rank_with_the_same_validation_lines(tmp_path):
    proc = verify(tmp_path, "outside,epoch-end,sigterm")  # a kill in a step: the oldest-version, MLM and GLUE tests
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith(("kill -9", "SIGTERM"))]
    names = [re.split(r"\s{2,}", r)[0] for r in rows]
    assert names == ["kill -9 outside a step (rank 1)", "kill -9 at an epoch's end (rank 1)",
                     "SIGTERM and a rerun (rank 1)"], proc.stdout
    assert all(" identical" in r for r in rows), proc.stdout
    outside = next(r for r in rows if r.startswith("kill -9 outside"))
    assert "all_gather" in outside, outside  # the Trainer's log of the loss, after the update
    reference = validation(tmp_path / "clean" / "launcher.log")
    assert len(reference) == STEPS // STEPS_PER_EPOCH, reference  # the epochs that ended before the last step
    for fault in ("outside", "epoch-end", "sigterm"):
        assert validation(tmp_path / fault / "launcher.log") == reference, fault


@pytest.mark.skipif(not OLDEST.is_dir(), reason="scripts/setup.sh installs the oldest accepted transformers there")
def test_a_fault_between_two_evaluations_with_the_best_model_loaded_at_the_end(tmp_path):
    """`load_best_model_at_end=True` on the validation loss, a checkpoint every epoch, and a kill after the first of
    two evaluations. Two things differed (`trainguard verify` said so) though the weights did not: the Trainer makes a
    new evaluation loader for every evaluation, so a run of the script after the fault made the second at another
    place of its count of loaders and was handed the first one's pass state; and the control rank 0 alone records in
    the Trainer's state when it saves reached the replacement of rank 1."""
    source = PORT.read_text()
    assert "        save_total_limit=2,\n" in source
    script = tmp_path / "train_best.py"
    script.write_text(source.replace("        save_total_limit=2,\n", "        save_total_limit=2,\n"
                                     "        load_best_model_at_end=True,\n        metric_for_best_model=\"eval_loss\",\n"))
    verify_identical(tmp_path / "runs", script, "mid-step", ["--epochs", "3", "--output_dir", "out"], steps=40,
                     workers=WORKERS)


def test_a_blind_masked_language_model_trainer_with_masks_drawn_in_loader_workers(tmp_path):
    """tests/jobs/hf_mlm.py, written for torchrun by a helper who never saw trainguard in run_mlm.py's shape (a BERT
    from a config, DataCollatorForLanguageModeling drawing the masks in 2 loader workers, evaluation and saves by steps,
    load_best_model_at_end, EarlyStoppingCallback, a callback of its own), ported by its Trainer import. Each fetch of
    the training loader is keyed, so the workers' seeds are the same after a restore (before, the state differed from
    the step of the kill, and after a SIGTERM and rerun; the SIGTERM is left to the every-fault test and to
    test_lightning's and test_accelerate's loader workers, for the suite's time)."""
    plain, port = ((REPO / "tests" / "jobs" / name).read_text().split('"""', 2)[2] for name in ("hf_mlm_plain.py",
                                                                                                "hf_mlm.py"))
    assert len(set(port.splitlines()) - set(plain.splitlines())) == 1  # the import
    verify_identical(tmp_path, REPO / "tests" / "jobs" / "hf_mlm.py", "mid-step",
                     ["--max_steps", "40", "--output_dir", "out"], steps=24, workers=3)


def test_a_blind_glue_trainer_whose_ranks_pad_their_batches_to_their_own_lengths(tmp_path):
    """tests/jobs/hf_glue.py (run_glue.py's shape, written blind): batches grouped by length and padded per batch, so
    each rank counts its own flops between logs. The state kept one rank's count for every rank, and after a kill the
    replacement's was a peer's: `total_flos` differed in the log history and the checkpoints (verify: "differs ...
    trainer.state"), every weight the same. Each rank's count is kept now, as its loss since the last log is."""
    verify_identical(tmp_path, REPO / "tests" / "jobs" / "hf_glue.py", "mid-step",
                     ["--output_dir", "out"], steps=24, workers=3)


def test_the_oldest_transformers_the_extra_accepts(tmp_path):
    oldest = {"PYTHONPATH": os.pathsep.join(filter(None, [str(OLDEST), os.environ.get("PYTHONPATH", "")]))}
    version = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                             env=env(**oldest), capture_output=True, text=True, timeout=60).stdout.strip()
    floor = re.search(r'"transformers>=([0-9.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert version == floor, (version, floor)
    verify(tmp_path, "mid-step", **oldest)
    assert "the training loader resumed at batch" in (tmp_path / "mid-step" / "launcher.log").read_text()
