"""Loops whose data come some other way than one batch a step from the training loader, ported by imports and a line
or two, under `trainguard run` with 3 ranks (split from test_ported_trainers.py so that the two files run in
parallel):

- stream.py: an IterableDataset stream with two loader workers under the training loader, its own checkpoint
  every 25 steps: kill -9 mid-stream and right after rank 0's save are bit-identical (the stream is read again up
  to the committed batch); under `elastic`, which changes the ranks that split it, refused at its first steps.
- stream_stateful.py: a stream whose dataset keeps its own position (torchdata's StatefulDataLoader protocol),
  with two loader workers and with none, under `trainguard verify`: resumed from the anchored worker states.
- cycle.py: a step loop fed by a generator that cycles over the epochs, under `trainguard verify`: started at the
  epoch its own step count gives (a kill at an epoch's end resumes in the next pass, at the same batch), and with
  epochs that end inside an accumulation cycle (a step takes the last batch of one pass and the first of the next:
  the run without a fault trains to its end, and a kill in such a step is bit-identical).
- prefetch.py: a batch taken ahead (during the step, between the backward and `optimizer.step()`; or by a
  prefetcher that takes the next batch before it hands out the current one, as timm's and apex's do), and each
  forward fed two batches; the training set augmenting in `__getitem__` from torch's global generator and a mixup
  weight drawn from NumPy's; one and two micro-batches a step; under `trainguard verify` a kill in a step of every
  shape, and a kill after a commit, at an epoch's end and a SIGTERM of two of them, are bit-identical (the position counted a batch taken ahead in the step that fetched it, a restore skipped it, and
  the run ended with exit 0, "lost 0 steps" and other weights; at an epoch's end the scheduler stepped twice).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import assert_identical, env, events

from test_ported_trainers import JOBS, WORKERS, run
from trainguard.exitcodes import EXIT_CONFIG_ERROR

pytestmark = pytest.mark.timeout(300)


def stream(out: Path, faults: str = "") -> tuple[list[dict], subprocess.CompletedProcess]:
    proc = run("stream.py", out, ["--ckpt", str(out / "ckpt.pt"), "--final-out", str(out / "final")], faults)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(out / f"final_rank{r}.pt", weights_only=True) for r in range(WORKERS)], proc


@pytest.fixture(scope="module")
def stream_baseline(tmp_path_factory) -> list[dict]:
    return stream(tmp_path_factory.mktemp("uninterrupted"))[0]


@pytest.mark.parametrize("fault", ["1:37:kill", "0:25:kill"])  # mid-stream; rank 0 right after its own save
def test_a_stream_with_two_loader_workers_resumes_bit_identically(tmp_path, stream_baseline, fault):
    """An IterableDataset stream (one per rank and loader worker, two workers) under the loader that trains: it has
    no position to set, so a restore reads it again up to the committed batch (and says what that cost)."""
    got, proc = stream(tmp_path, fault)
    assert [e for e in events(tmp_path) if e["event"] == "fault_injected"], "the fault did not fire"
    assert re.search(r"the training stream resumed at batch \d+ of its pass: its first \d+ batches were read again",
                     proc.stderr), proc.stderr[-2000:]
    assert_identical(got, stream_baseline, "every rank's final state")


@pytest.mark.parametrize("workers, faults", [("2", "sigterm"), ("0", "mid-step")])  # suite time: one fault each
def test_a_stream_that_keeps_its_own_position_resumes_from_it_bit_identically(tmp_path, workers, faults):
    """A dataset with state_dict()/load_state_dict() (torchdata's StatefulDataLoader protocol), masking at random
    with Python's global generator in its loader workers: a kill in step 20 resumes from the states anchored at
    batch 16 (the peers', for the replacement; the checkpoint's, for the rerun), reading 4-5 batches again instead
    of 20, and every tensor of every rank, the anchors' worker states included, is the same as without a fault."""
    proc = subprocess.run([sys.executable, "-m", "trainguard", "verify", "--steps", "40", "--keep", str(tmp_path),
                           "--workers", str(WORKERS), "--faults", faults, str(JOBS / "stream_stateful.py"),
                           "--max-steps", "60", "--num-workers", workers],
                          cwd=tmp_path, env=env(TG_EXACT=""), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith(("kill -9", "SIGTERM"))]
    assert len(rows) == len(faults.split(",")) and all(" identical" in r for r in rows), proc.stdout
    for fault in faults.split(","):
        log = (tmp_path / fault / "launcher.log").read_text()
        assert re.search(r"resumed at batch 2\d of its pass: from its state saved at batch 16, the \d batches", log), \
            log[-3000:]


def test_a_stream_under_elastic_is_refused_at_its_first_steps(tmp_path):
    proc = run("stream.py", tmp_path, ["--ckpt", str(tmp_path / "ckpt.pt")], extra_args=["--recover-strategy", "elastic"])
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "reads an IterableDataset (a stream)" in proc.stderr and "elastic" in proc.stderr
    steps = [e["step"] for e in events(tmp_path) if e["event"] == "progress"]
    assert max(steps, default=0) <= 2, steps  # at the first commit, not at the first fault
    assert "back to step" not in proc.stdout + proc.stderr  # no rank ran the script again: nothing was retried


@pytest.mark.parametrize("shape, faults", [
    ("--epoch-from-steps", "epoch-end"),  # the pass the script's count starts, after an epoch's end
    ("", "mid-step"),  # step 5 takes the last batch of epoch 2 and the first of epoch 3: killed in it
])
def test_a_loop_over_steps_fed_by_a_cycling_generator_is_bit_identical(tmp_path, shape, faults):
    cmd = [sys.executable, "-m", "trainguard", "verify", "--steps", "10", "--keep", str(tmp_path), "--workers",
           str(WORKERS), "--faults", faults, str(JOBS / "cycle.py"), "--max-steps", "12", *filter(None, [shape])]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(TG_EXACT=""), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("kill -9")]
    assert len(rows) == 1 and " identical" in rows[0], proc.stdout
    if shape:
        assert "the first epoch's last" in rows[0], rows


@pytest.mark.parametrize("shape, accum, trained", [
    ("during", "1", 1),  # the next batch taken between the backward and optimizer.step()
    ("ahead", "2", 2),  # a prefetcher that takes the next batch before it hands out the current one (timm, apex)
    ("concat", "1", 2),  # no prefetch: each forward takes two batches
])
def test_a_batch_taken_ahead_with_global_generator_draws_is_bit_identical(tmp_path, shape, accum, trained):
    faults = {("during", "1"): ["mid-step", "epoch-end", "sigterm"], ("ahead", "2"): ["mid-step",
              "after-commit", "epoch-end"]}.get((shape, accum), ["mid-step"])  # the other two: a kill in a step (suite
    # time: what a commit and an epoch's end do with a batch taken ahead does not depend on how many a forward trains)
    cmd = [sys.executable, "-m", "trainguard", "verify", "--steps", "16", "--keep", str(tmp_path), "--workers",
           str(WORKERS), "--faults", ",".join(faults), str(JOBS / "prefetch.py"), "--accum", accum, "--shape", shape]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(TG_EXACT=""), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith(("kill -9", "SIGTERM"))]
    assert len(rows) == len(faults) and all(" identical" in r for r in rows), proc.stdout  # the SIGTERM and rerun
    # once (its resume point is the committed step's, the same whatever the batch was taken: suite time)
    steps = 12 // trained  # 12 batches a rank an epoch
    assert "epoch-end" not in faults or f"right after step {steps}, the first epoch's last" in proc.stdout, proc.stdout
    resumed = (tmp_path / "mid-step" / "launcher.log").read_text()
    # killed in step 9's forward: the job resumes at 8, or at 7 where the survivors saw the fault at the batch they take
    # during step 8, before its update (the dead rank had committed it alone)
    at = int(re.search(r"recovery 1: .* resumed at step (\d+)", resumed).group(1))
    assert at in (7, 8), resumed[-2000:]
    position = f"resumed at step {at} (epoch {at // steps}, batch {at % steps * trained})"  # the batches trained
    assert position in resumed, resumed[-2000:]


def test_a_sum_over_the_epochs_batches_after_a_resume_at_its_end_ends_the_job_at_once_naming_why(tmp_path):
    """run_clm_no_trainer's shape: `total_loss = 0`, `total_loss += loss.detach()` in the loop, `total_loss.item()`
    after it. A kill right after the epoch's last step sends every rank back there; the loop takes no batch, and every
    rank raises AttributeError on the int. Before, the ranks' error vote compared the step each had last begun (a
    replacement had begun none), disagreed, and the job restarted every worker, lost the live state and gave up,
    naming the kill as its root cause. Now it ends at once, exit 78, naming the error and why the sum is empty."""
    proc = run("prefetch.py", tmp_path, ["--sum-loss", "--epochs", "2"], faults="1:12:kill")
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "AttributeError: 'int' object has no attribute 'item'" in proc.stderr
    assert "every rank raised it at the same step" in proc.stderr
    assert "resumed after epoch 0's last batch" in proc.stderr and "register_state" in proc.stderr
    assert proc.stderr.count("restarting worker") == 1 and "giving up" not in proc.stderr  # only the killed one


def test_an_error_one_rank_raises_again_after_the_resume_it_follows_ends_the_job_at_once_naming_it(tmp_path):
    """A blind DDP trainer's shape: rank 0 alone prints the epoch's last `loss` after the loop. A kill right after the
    epoch's last step sends every rank back there, the loop takes no batch, and rank 0 alone raises NameError. Before,
    that was a fault each time: a crash loop of rank 0 (four restarts), and the root cause named the kill. Now the
    first time is recovered as a fault, and the same error at the same step once more ends the job, exit 78, naming
    it and why."""
    proc = run("prefetch.py", tmp_path, ["--last-loss", "--epochs", "2"], faults="1:12:kill")
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "NameError: name 'loss' is not defined" in proc.stderr
    assert "rank 0 raised it again at step 12, where it raised it before the job recovered" in proc.stderr
    assert "resumed after epoch 0's last batch" in proc.stderr
    assert proc.stderr.count("restarting worker") == 2 and "giving up" not in proc.stderr  # the kill, the first error
