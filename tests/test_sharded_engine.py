"""Sharded models on the one engine, as a user ports a trainer: tests/jobs/sharded_trainer.py under
`trainguard run` (real processes, real kill -9, real SIGTERM), with the user's own `fully_shard` /
`parallelize_module` on a mesh from `trainguard.init_device_mesh`, two loaders (training, and an eval pass
with a metric all-reduce), SGD with momentum, an LR scheduler stepped after the optimizer, dropout and
(`--bn`) a BatchNorm.

Each layout runs once uninterrupted, and then with faults; every tensor of every rank's part (model and
its buffers, optimizer state and hyperparameters, scheduler) is torch.equal to the uninterrupted run's,
and so is rank 0's loss at every step. With 3 and 4 ranks the sums of FSDP's reduce-scatter and of
the eval all-reduce depend on their order, so a rank that came back with other state or other data
would show.

The matrix, several faults a run: fsdp (3 ranks) has each rank position killed or SIGSTOPped; hsdp (2x2) a
kill, a kill of the rank that sends the replacement its shard (a kill during the recovery) and the
scheduler's SIGKILL; dptp (2x2) a tensor-parallel rank and rank 0 killed; the FSDP2 tutorial (2 ranks) each
rank position; fsdp SIGTERM and a rerun from the dying gasp; a shard lost with its only copy. DP x TP
resharded from 4 to 2 ranks after a SIGTERM is tests/test_transformer_tp.py, and the sliced checkpoint as
the source of a live recovery tests/test_sharded_recovery.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import REPO, env, run_logged

import trainguard as tg
from trainguard.checkpoint.codec import flatten_state

pytestmark = pytest.mark.timeout(400)
JOB = REPO / "tests" / "jobs" / "sharded_trainer.py"
WORLD = {"fsdp": 3, "hsdp-2x2": 4, "dptp-2x2": 4, "dp": 3}


def run(tmp: Path, name: str, layout: str, *args: str, faults: str = "", expect: int = 0,
        ckpt: Path | None = None, at_collective: str = "") -> str:
    out = tmp / name
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", str(WORLD[layout]), "--hot-spares", "0",
           "--recovery-path", str(out / "recovery"), str(JOB), layout, str(out), *args]
    extra = {"TG_CHECKPOINT_DIR": str(ckpt)} if ckpt is not None else {}
    extra["TG_FAULT_COLLECTIVE"] = at_collective
    proc = run_logged(cmd, out, env(TG_FAULT=faults, **extra), 300)
    log = proc.stdout + "\n--- stderr ---\n" + proc.stderr
    (out / "launcher.log").write_text(log)
    assert proc.returncode == expect, log[-5000:]
    return log


def parts(out: Path, world: int) -> dict[str, torch.Tensor]:
    got = {}
    for r in range(world):
        tensors, meta = flatten_state(tg.load_state(out / f"rank{r}.safetensors"))
        got.update({f"rank{r}/{k}": v for k, v in tensors.items()})
        got[f"rank{r}/meta"] = meta
    return got


def losses(out: Path) -> dict[int, str]:
    """Rank 0's loss after each step; a step trained again (after a recovery) counts with its last value."""
    trace = {}
    for line in (out / "losses.txt").read_text().splitlines():
        step, loss = line.split()
        trace[int(step)] = loss
    return trace


def assert_same_run(tmp: Path, got: str, want: str, layout: str) -> None:
    a, b = parts(tmp / got, WORLD[layout]), parts(tmp / want, WORLD[layout])
    assert a.keys() == b.keys() and any("optim" in k for k in a) and "last_epoch" in str(a["rank0/meta"])  # the scheduler
    differ = [k for k in a if k.endswith("/meta") and a[k] != b[k] or
              not k.endswith("/meta") and not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]
    assert not differ, f"differ from the uninterrupted run: {differ[:6]}"
    assert losses(tmp / got) == losses(tmp / want)


def events(tmp: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp / name / "recovery" / "events.jsonl").read_text().splitlines()]


def fired(tmp: Path, name: str) -> list[dict]:
    return [e for e in events(tmp, name) if e.get("event") == "fault_injected"]


def restored(tmp: Path, name: str) -> list[dict]:
    return [e for e in events(tmp, name) if e.get("event") == "restored" and e.get("source") != "init"]


@pytest.fixture(scope="module")
def refs(tmp_path_factory) -> Path:
    """The uninterrupted runs: fsdp and dptp with a BatchNorm, hsdp without (its ranks are then replicas)."""
    tmp = tmp_path_factory.mktemp("sharded_refs")
    run(tmp, "fsdp", "fsdp", "--bn")
    run(tmp, "hsdp-2x2", "hsdp-2x2")
    run(tmp, "dptp-2x2", "dptp-2x2", "--bn")
    return tmp


def test_fsdp_survives_each_rank_position_killed_or_stopped_bit_identically(refs, tmp_path):
    """3 ranks, 9 steps an epoch: rank 1 dies after step 5, rank 0 after step 9, the last of epoch 0 (before its
    eval), and rank 2 is SIGSTOPped after step 14 (the scheduler finds it silent and kills it)."""
    log = run(tmp_path, "faulty", "fsdp", "--bn", faults="1:5:kill,0:9:kill,2:14:stop")
    assert log.count("was killed by signal SIGKILL") == 3, log[-4000:]
    # the survivors ran the script again (rank 1's second process twice): its earlier runs' models are gone
    assert sorted(re.findall(r"rank (\d): live models (\d+)", log)) == [("0", "1"), ("1", "1"), ("2", "1")], log[-4000:]
    assert len(fired(tmp_path, "faulty")) == 3
    got = {(e["rank"], e["source"]) for e in restored(tmp_path, "faulty")}
    assert {(0, "peer"), (1, "peer"), (2, "peer")} <= got, got  # each replacement took its shard from its buddy's copy
    (tmp_path / "fsdp").symlink_to(refs / "fsdp")
    assert_same_run(tmp_path, "faulty", "fsdp", "fsdp")


def test_hsdp_survives_a_kill_during_the_recovery_and_the_schedulers_kill(refs, tmp_path):
    """2x2: rank 2 dies after step 4; its live replica, rank 0, is killed as it sends it its shard (its first
    `send`), so both holders of that shard are gone and it comes back from the in-memory copy on another shard's
    rank; later the scheduler is killed (SIGKILL) after step 10 and the job goes on under its restart."""
    log = run(tmp_path, "faulty", "hsdp-2x2", faults="2:4:kill,1:10:sched", at_collective="0:send:1")
    assert [e["how"] for e in fired(tmp_path, "faulty")] == ["kill", "kill@send", "sched"], log[-4000:]
    assert any(e["event"] == "scheduler_started" and e["resumed"] for e in events(tmp_path, "faulty"))
    mine = [e for e in restored(tmp_path, "faulty") if e["rank"] in (0, 2)]  # the two holders of that shard
    assert {(e["rank"], e["source"], e["copy"]) for e in mine} == {(0, "peer", "memory"), (2, "peer", "memory")}, mine
    (tmp_path / "hsdp-2x2").symlink_to(refs / "hsdp-2x2")
    assert_same_run(tmp_path, "faulty", "hsdp-2x2", "hsdp-2x2")


def test_dp_x_tp_survives_kill_9_of_a_tensor_parallel_rank_and_of_rank_0(refs, tmp_path):
    log = run(tmp_path, "faulty", "dptp-2x2", "--bn", faults="3:7:kill,0:11:kill")
    assert log.count("was killed by signal SIGKILL") == 2, log[-4000:]
    assert "functional" in log or "CollectiveFailed" in log, log[-4000:]  # DTensor's collectives fail typed
    (tmp_path / "dptp-2x2").symlink_to(refs / "dptp-2x2")
    assert_same_run(tmp_path, "faulty", "dptp-2x2", "dptp-2x2")


def test_sigterm_stops_every_rank_with_its_shard_on_disk_and_a_rerun_goes_on_bit_identically(refs, tmp_path):
    ckpt = tmp_path / "ckpt"
    run(tmp_path, "faulty", "fsdp", "--bn", faults="1:4:term", expect=75, ckpt=ckpt)
    assert [p.name for p in ckpt.iterdir() if p.is_dir()], "no dying-gasp checkpoint was written"
    log = run(tmp_path, "faulty", "fsdp", "--bn", ckpt=ckpt)
    assert "resumed at step 4" in log or "resumed at step 5" in log, log[-4000:]
    (tmp_path / "fsdp").symlink_to(refs / "fsdp")
    assert_same_run(tmp_path, "faulty", "fsdp", "fsdp")


def test_a_shard_lost_with_its_only_copy_ends_the_job_saying_so_and_never_starts_over(tmp_path):
    """fsdp with a BatchNorm: every rank is its own shard, and its only copy is on its buddy. Rank 1 dies after
    step 3; rank 2 dies as it sends rank 1's replacement that copy (its first `send`): shards 1 and 2 are gone
    from memory, and there is no checkpoint. The job must fail, naming the cause and the fix; it once
    restarted every process and trained again from step 0, exiting 0 with other weights."""
    log = run(tmp_path, "faulty", "fsdp", "--bn", faults="1:3:kill", at_collective="2:send:1", expect=1)
    kills = [line for line in log.splitlines() if line.startswith("[agent]") and "killed by signal SIGKILL" in line]
    assert len(kills) == 2, log[-4000:]
    assert "the job cannot be restored: no step can be restored on every shard" in log, log[-4000:]
    assert "keep a replica of every shard" in log, log[-4000:]  # the fix it names
    assert "resumed at step 0" not in log and "generation 4" not in log, log[-4000:]
    assert all(e["source"] != "init" for e in events(tmp_path, "faulty") if e.get("event") == "restored"
               and e["generation"] > 1)


def test_data_parallel_with_sliced_checkpoints_comes_back_from_disk_when_every_rank_dies(tmp_path):
    """The same checkpoints serve data parallelism (3 ranks, a BatchNorm): every rank is killed after step 6, so no
    live state is left, and the job goes back to the sliced checkpoint of step 4 and trains steps 5 and 6 again."""
    run(tmp_path, "ref", "dp", "--bn")
    log = run(tmp_path, "faulty", "dp", "--bn", "--sliced", str(tmp_path / "sliced"),
              faults="0:6:kill,1:6:kill,2:6:kill")
    assert len(fired(tmp_path, "faulty")) == 3, log[-4000:]
    assert {(e["rank"], e["step"], e["source"]) for e in restored(tmp_path, "faulty")} == \
        {(r, 4, "disk") for r in range(3)}, log[-4000:]
    assert "from the checkpoint on disk (" in log and "sliced-1_4)" in log, log[-4000:]
    assert_same_run(tmp_path, "faulty", "ref", "dp")


TUTORIAL = REPO / "examples" / "fsdp2_tutorial.py"


def test_the_ported_fsdp2_tutorial_survives_kill_9_bit_identically(tmp_path):
    """examples/fsdp2_tutorial.py: PyTorch's FSDP2 tutorial with its port marked line by line (at most 10)."""
    marked = [line for line in TUTORIAL.read_text().splitlines() if line.rstrip().endswith("# trainguard")
              or "# trainguard:" in line]
    assert 0 < len(marked) <= 10, marked
    small = ("--layers", "2", "--batch-size", "4", "--steps", "12", "--dropout", "0.1")
    for name, faults in (("uninterrupted", ""), ("faulty", "1:4:kill,0:8:kill")):  # 2 ranks: each position
        cmd = [sys.executable, "-m", "trainguard", "run", "--workers", "2", "--hot-spares", "0", "--recovery-path",
               str(tmp_path / name / "recovery"), str(TUTORIAL), *small, "--out", str(tmp_path / name)]
        proc = subprocess.run(cmd, cwd=REPO, env=env(TG_FAULT=faults), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert proc.stderr.count("was killed by signal SIGKILL") == 2, proc.stderr[-4000:]
    a, b = parts(tmp_path / "faulty", 2), parts(tmp_path / "uninterrupted", 2)
    assert a.keys() == b.keys() and any("optim" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a if not k.endswith("/meta"))
