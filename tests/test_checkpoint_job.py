"""Checkpoints of real 2-worker jobs: a deleted shard, kill -9 mid-write and a full disk.

Each case must end exactly where a job that nothing happened to ends: every step's loss and
the final state of every rank (model, optimizer, scheduler, RNG) equal, bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO, assert_identical, env, events, finals, run_logged

from trainguard.checkpoint import list_checkpoints, read_manifest, verify_checkpoint
from trainguard.exitcodes import EXIT_PREEMPTED

pytestmark = pytest.mark.timeout(120)

JOB = REPO / "tests" / "jobs" / "ckpt_job.py"
STEPS = 24  # 3 epochs of 8 steps; a checkpoint every 4 steps


def run_job(out: Path, *extra: str, max_restarts: int = 0, **env_extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", "2", "--max-restarts", str(max_restarts),
           "--recovery-path", str(out / "recovery"), str(JOB), "--out", str(out / "final"),
           "--ckpt", str(out / "ckpt"), *extra]
    proc = run_logged(cmd, out, env(**env_extra), timeout=90)  # a hang fails with every worker's stacks
    with open(out / "launcher.log", "a") as log:
        log.write(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    return proc


def losses(out: Path) -> list[dict[int, str]]:
    """Each rank's loss per step (float.hex); a step redone after a rollback counts as redone."""
    per_rank = []
    for rank in range(2):
        lines = (out / "final" / f"losses_rank_{rank}.jsonl").read_text().splitlines()
        per_rank.append({(e := json.loads(line))["step"]: e["loss"] for line in lines})
    return per_rank


def complete(out: Path) -> list[int]:
    return [c.step for c in list_checkpoints(out / "ckpt", "job")]


def restored_from_disk(out: Path) -> dict[int, int]:
    return {e["rank"]: e["step"] for e in events(out) if e["event"] == "restored" and e["source"] == "disk"}


def check_same_as(out: Path, baseline, *, killed: int | None = None) -> None:
    """Same losses and final states as the baseline. A `killed` rank may lack the loss of the one step it
    died in: when its peers committed that step (commit-or-skip), its replacement resumes after it."""
    got_losses = losses(out)
    for rank in range(2):
        got, want = got_losses[rank], baseline["losses"][rank]
        missing = sorted(set(range(STEPS)) - set(got))
        assert len(missing) <= (1 if rank == killed else 0), f"rank {rank}: no loss logged for steps {missing}"
        assert got == {s: v for s, v in want.items() if s in got}, f"rank {rank}: the loss curve differs"
        assert_identical(finals(out, 2)[rank], baseline["finals"][rank], f"rank {rank}")


def all_verify(out: Path) -> None:
    for info in list_checkpoints(out / "ckpt", "job"):
        result = verify_checkpoint(info.path)
        assert result.ok, (info.path, result.problems)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out = tmp_path_factory.mktemp("baseline")
    proc = run_job(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert complete(out) == [4, 8, 12, 16, 20, 24]
    all_verify(out)
    return {"losses": losses(out), "finals": finals(out, 2)}


def test_one_folder_per_checkpoint_with_every_rank_and_the_manifest(tmp_path):
    proc = run_job(tmp_path, "--epochs", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = tmp_path / "ckpt" / "job-1_8"
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "rank_0.safetensors", "rank_1.safetensors"]
    m = read_manifest(folder)
    assert (m["format_version"], m["step"], m["epoch"], m["world_size"]) == (3, 8, 1, 2)
    assert m["append_info"] == {"job": "ckpt_job"}
    assert m["ranks"]["1"]["progress"] == {"step": 8, "epoch": 1, "in_epoch": 0}
    # data parallel: the files are replicas of each other, byte for byte
    assert m["files"]["rank_0.safetensors"] == m["files"]["rank_1.safetensors"]
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")]


def test_a_deleted_shard_of_rank_0_comes_back_from_its_replica(baseline, tmp_path):
    stopped = run_job(tmp_path, TG_FAULT="1:5:term")  # every rank stops at step 6 with a checkpoint of it
    assert stopped.returncode == EXIT_PREEMPTED, stopped.stderr[-3000:]
    assert complete(tmp_path) == [4, 6]
    newest = tmp_path / "ckpt" / "job-1_6"
    original = (newest / "rank_0.safetensors").read_bytes()
    (newest / "rank_0.safetensors").unlink()
    assert complete(tmp_path) == [4, 6]  # rank 1's bit-identical file stands in

    again = run_job(tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert restored_from_disk(tmp_path) == {0: 6, 1: 6}
    (repaired,) = [e for e in events(tmp_path) if e["event"] == "checkpoint_repaired"]
    assert (repaired["rank"], repaired["step"], repaired["replica"]) == (0, 6, "rank_1.safetensors")
    assert "rank_0.safetensors: is missing" in again.stderr
    assert (newest / "rank_0.safetensors").read_bytes() == original
    check_same_as(tmp_path, baseline)
    all_verify(tmp_path)


def test_kill_9_mid_write_then_the_whole_job_restarts_from_the_previous_checkpoint(baseline, tmp_path):
    killed = run_job(tmp_path, "--kill-in-save", "1:8")  # rank 1 dies with its file of step 8 written
    assert killed.returncode != 0
    assert "killing myself in the checkpoint write of step 8" in killed.stdout + killed.stderr
    assert complete(tmp_path) == [4]
    (cut,) = (tmp_path / "ckpt").glob(".job-1_8.tmp-*")
    assert [p for p in cut.iterdir() if p.name.startswith(".rank_1.safetensors.")]  # written, never renamed
    assert not (cut / "manifest.json").exists()
    assert verify_checkpoint(tmp_path / "ckpt" / "job-1_4").ok

    again = run_job(tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert restored_from_disk(tmp_path) == {0: 4, 1: 4}
    check_same_as(tmp_path, baseline)
    assert complete(tmp_path) == [4, 8, 12, 16, 20, 24]  # step 8 saved again, into the same temp folder
    assert not list((tmp_path / "ckpt").glob(".job-*"))
    all_verify(tmp_path)


def test_kill_9_of_a_worker_mid_write_leaves_that_checkpoint_out(baseline, tmp_path):
    proc = run_job(tmp_path, "--kill-in-save", "1:8", max_restarts=2)  # the launcher restarts rank 1
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restarting worker 1" in proc.stderr
    assert complete(tmp_path) == [4, 12, 16, 20, 24]
    check_same_as(tmp_path, baseline, killed=1)
    all_verify(tmp_path)


def test_a_full_disk_is_reported_and_training_goes_on(baseline, tmp_path):
    proc = run_job(tmp_path, TG_FAULT_DISK_FULL="1:8,0:16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr
    assert "[worker 1] trainguard: rank 1: checkpoint of step 8 failed, training goes on: rank 1 could not " \
           "write its part of step 8" in err and "No space left on device" in err
    assert "[worker 0] trainguard: rank 0: checkpoint of step 16 failed" in err
    failed = {(e["rank"], e["step"]) for e in events(tmp_path) if e["event"] == "checkpoint_failed"}
    assert {(1, 8), (0, 8), (0, 16)} <= failed  # rank 0 gave up committing step 8 at once
    assert complete(tmp_path) == [4, 12, 20, 24]
    names = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert not {"job-1_8", "job-2_8"} & names  # nothing that looks like a checkpoint of steps 8 and 16
    assert not [n for n in names if n.startswith(".job-1_8")]  # step 8's temp folder is gone too
    check_same_as(tmp_path, baseline)
    all_verify(tmp_path)


def test_saves_by_the_clock_are_agreed_so_every_one_completes(baseline, tmp_path):
    proc = run_job(tmp_path, "--save-steps", "0", "--save-seconds", "0.3", "--step-sleep", "0.05")
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = [e["step"] for e in events(tmp_path) if e["event"] == "checkpoint_saved"]
    assert saved and saved == sorted(set(saved)) and complete(tmp_path) == saved[-10:]
    assert not [e for e in events(tmp_path) if e["event"] == "checkpoint_failed"]
    assert not list((tmp_path / "ckpt").glob(".job-*"))  # no rank saved a step the other did not
    check_same_as(tmp_path, baseline)
