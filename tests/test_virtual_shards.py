"""Virtual shards (`--virtual-shards V`; train/parallel/exactsum.py): a trainer written as people write them
(tests/jobs/vshards.py: BatchNorm, dropout, SGD with momentum, a StepLR, an eval pass) trains to the same bits at
every world size, so an elastic job that shrinks and grows back with real kill -9s ends torch.equal to an
uninterrupted run, with the same loss at every step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import REPO, assert_identical, env, events

from trainguard.launch.policy import EXIT_CONFIG

pytestmark = pytest.mark.timeout(240)

JOB = REPO / "tests" / "jobs" / "vshards.py"
SHARDS = "12"


def run(out: Path, workers: int, *flags: str, fault: str = "", epochs: int = 3, job_args: tuple = ()):
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", str(workers), "--virtual-shards", SHARDS,
           "--recovery-path", str(out / "recovery"), *flags, str(JOB), "--out", str(out), "--epochs", str(epochs),
           *job_args]
    proc = subprocess.run(cmd, cwd=REPO, env=env(TG_FAULT=fault), capture_output=True, text=True, timeout=200)
    (out / "launcher.log").parent.mkdir(parents=True, exist_ok=True)
    (out / "launcher.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    return proc


def result(out: Path) -> tuple[dict, dict[int, float]]:
    """The final state, and the loss of every step (a step run again after a fault: its last run)."""
    losses = {}
    for line in (out / "losses.jsonl").read_text().splitlines():
        entry = json.loads(line)
        losses[entry["step"]] = entry["loss"]
    return torch.load(out / "final.pt"), losses


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, tuple]:
    """Uninterrupted runs on 4 workers, for 3 and 4 epochs."""
    runs = {}
    for epochs in (3, 4):
        out = tmp_path_factory.mktemp(f"uninterrupted{epochs}")
        proc = run(out, 4, epochs=epochs)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[epochs] = result(out)
    return runs


def test_two_workers_train_to_the_bits_of_four(tmp_path, uninterrupted):
    """(Three workers: the shrink 4 -> 3 below ends at 3, and the blind trainer's test runs 3 against 4.)"""
    proc = run(tmp_path, 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state, losses = result(tmp_path)
    assert_identical(uninterrupted[3][0], state, "2 workers")
    assert losses == uninterrupted[3][1]


def test_noise_drawn_in_two_loader_workers_is_the_same_on_three_workers_as_on_four(tmp_path):
    """Each sample's draws in a loader worker are keyed by the sample (train/data/loaderseed.py), not the rank (in the
    main process: the blind trainer's test below)."""
    results = []
    for workers in (4, 3):
        out = tmp_path / str(workers)
        proc = run(out, workers, job_args=("--num-workers", "2"), epochs=2)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(result(out))
    assert_identical(results[0][0], results[1][0], "3 workers")
    assert results[0][1] == results[1][1]


def test_without_virtual_shards_the_world_size_changes_the_result(tmp_path, uninterrupted):
    """The test above can fail: the float sum over 3 ranks of their 4 shards each is other bits."""
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", "3", "--recovery-path", str(tmp_path / "r"),
           str(JOB), "--out", str(tmp_path), "--epochs", "3", "--batch-size", "16"]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state, _ = result(tmp_path)
    assert not all(torch.equal(a, b) for a, b in zip(state["model"].values(), uninterrupted[3][0]["model"].values()))


def test_kills_in_a_forward_an_exchange_and_after_a_commit_recover_in_place_bit_identical(tmp_path, uninterrupted):
    """Without elastic (a hot spare replaces each dead rank), under --exact strict: three kill -9s at 3 workers."""
    proc = run(tmp_path, 3, fault="1:8:kill,2:15:kill-forward,0:22:kill-exchange")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (proc.stdout + proc.stderr).count("trainguard: recovery ") == 3, proc.stderr[-3000:]
    state, losses = result(tmp_path)
    assert_identical(uninterrupted[3][0], state, "3 kills")
    assert losses == uninterrupted[3][1]


def test_a_kill_with_no_replacement_shrinks_4_to_3_and_ends_bit_identical(tmp_path, uninterrupted):
    """Rank 1 is killed after step 8 and its replacements die at start (a host that stays down): after the
    elastic deadline the job goes on at 3 workers, and ends with every tensor and every step's loss equal."""
    proc = run(tmp_path, 4, "--recover-strategy", "elastic", "--elastic-deadline", "1", fault="1:8:kill",
               job_args=("--restarted", "die"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    worlds = [e["world_size"] for e in events(tmp_path) if e["event"] == "generation_formed"]
    assert worlds == [4, 3], worlds
    assert "the job finished with 3 of its 4 workers" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    state, losses = result(tmp_path)
    assert_identical(uninterrupted[3][0], state, "4 -> 3")
    assert losses == uninterrupted[3][1]


def test_two_kills_shrink_4_to_2_and_the_returns_grow_it_back_to_4_bit_identical(tmp_path, uninterrupted):
    """Two kills, each replacement back 4 s later (past the 1-s deadline): 4 -> 3 -> 2 -> 3 -> 4 workers."""
    proc = run(tmp_path, 4, "--recover-strategy", "elastic", "--elastic-deadline", "1", fault="1:5:kill,2:9:kill",
               epochs=4, job_args=("--restarted", "wait", "4", "--step-sleep", "0.3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    worlds = [e["world_size"] for e in events(tmp_path) if e["event"] == "generation_formed"]
    assert min(worlds) == 2 and worlds[0] == worlds[-1] == 4, worlds
    report = subprocess.run([sys.executable, "-m", "trainguard", "report", str(tmp_path / "recovery")], cwd=REPO,
                            env=env(), capture_output=True, text=True, timeout=60).stdout
    assert "world size: 4 (generation 1," in report and "-> 2 (generation" in report, report  # each change, reported
    state, losses = result(tmp_path)
    assert_identical(uninterrupted[4][0], state, "4 -> 2 -> 4")
    assert losses == uninterrupted[4][1]


def test_a_step_that_does_not_split_its_batch_is_refused_naming_micro_batches(tmp_path):
    proc = run(tmp_path, 3, job_args=("--no-split",))
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert "--virtual-shards 12 this rank holds shards" in proc.stderr, proc.stderr[-3000:]
    assert "trainguard.micro_batches" in proc.stderr, proc.stderr[-3000:]


def test_a_model_not_wrapped_in_trainguard_ddp_is_refused_at_start(tmp_path):
    proc = run(tmp_path, 2, job_args=("--no-ddp",))
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert "--virtual-shards 12 needs the model wrapped in trainguard.DDP" in proc.stderr, proc.stderr[-3000:]


def test_fewer_shards_than_workers_is_refused_at_start(tmp_path):
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", "4", "--virtual-shards", "3", str(JOB),
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_CONFIG and "fewer than the job's 4 workers" in proc.stderr, proc.stderr[-2000:]


def test_a_sharded_model_under_elastic_is_refused_naming_what_to_use(tmp_path):
    """FSDP2 shards are not re-laid onto fewer ranks (issue 41): the job ends at start with exit 78, the message
    naming the strategy that does recover it and the way to shrink exactly."""
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", "2", "--recover-strategy", "elastic",
           "--elastic-deadline", "1", "--recovery-path", str(tmp_path / "r"), str(REPO / "examples" / "fsdp2_tutorial.py"),
           "--steps", "3", "--layers", "2"]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert "elastic cannot re-lay its shards" in proc.stderr, proc.stderr[-3000:]
    assert "recover-in-place" in proc.stderr and "--virtual-shards" in proc.stderr, proc.stderr[-3000:]


def test_a_trainer_written_blind_trains_to_the_same_bits_on_three_workers_with_a_kill_as_on_four(tmp_path):
    """tests/jobs/vshards_blind.py (augmentation in the main process's `__getitem__`, keyed per sample there too under
    virtual shards; epochs numbered from 1): 4 workers uninterrupted, 3 with rank 1 killed in epoch 2; every model,
    optimizer and scheduler tensor is equal, and the recovery does not call the loop's first epoch, `start_epoch(1)`,
    the script's own resume point. (Before the per-sample keying in the main process, 3 workers differed.)"""
    blind = REPO / "tests" / "jobs" / "vshards_blind.py"
    outs = {}
    for workers, fault in ((4, ""), (3, "1:20:kill")):
        out = tmp_path / str(workers)
        cmd = [sys.executable, "-m", "trainguard", "run", "--workers", str(workers), "--virtual-shards", SHARDS,
               "--recovery-path", str(out / "recovery"), str(blind), "--epochs", "2", "--out", str(out / "final.pt")]
        proc = subprocess.run(cmd, cwd=REPO, env=env(TG_FAULT=fault), capture_output=True, text=True, timeout=200)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs[workers] = torch.load(out / "final.pt")
    assert (proc.stdout + proc.stderr).count("trainguard: recovery ") == 1, proc.stderr[-3000:]
    assert "the script's own resume point" not in proc.stderr, proc.stderr[-3000:]
    assert_identical(outs[4], outs[3], "3 workers, a kill")


def test_verify_kills_a_loop_numbered_from_1_at_its_real_epoch_end(tmp_path):
    """`trainguard verify`'s epoch-end fault on tests/jobs/vshards_blind.py (`start_epoch(1)`, 15 steps an epoch on 12
    shards of 8 samples): the kill lands right after step 15, and the run is identical. (It landed after step 1,
    taking the loop's first epoch, 1, for an epoch already ended.)"""
    cmd = [sys.executable, "-m", "trainguard", "verify", "--steps", "20", "--workers", "3", "--virtual-shards", SHARDS,
           "--faults", "epoch-end", "--keep", str(tmp_path), str(REPO / "tests" / "jobs" / "vshards_blind.py"),
           "--epochs", "2", "--out", "out.pt"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(TG_EXACT=""), capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "right after step 15, the first epoch's last" in proc.stdout, proc.stdout[-3000:]
    assert "every run is identical to the one without a fault" in proc.stdout, proc.stdout[-3000:]
