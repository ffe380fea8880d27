"""Trainers written the way other people write them, ported by imports and a line or two (tests/jobs/*_torchrun.py
are the originals), under `trainguard run` with 3 ranks:

- mingpt.py: pytorch/examples' minGPT-ddp shape. Its loop numbers epochs from 1 (`epoch += 1`, then
  `set_epoch(epoch)`), steps a StepLR after each epoch's pass, evaluates with an `all_reduce` after it, and rank 0
  saves its own snapshot, which every rank loads when the script runs again. Kill -9 right after an epoch's last
  step, mid-epoch, and inside the test pass's all_reduce: every tensor of every rank is `torch.equal` to an
  uninterrupted run, and so are the test losses.
- torchrun_env.py: reads torchrun's variables before any trainguard call; a replacement sees the values a
  torchrun restart gives.
- imagenet_style.py: an image classifier written blind for torchrun in the shape of pytorch/examples' imagenet and
  timm's train.py (loader workers with `persistent_workers`, a `worker_init_fn` and a seeded generator, augmentation
  with NumPy and torch in `__getitem__`, mixup, `no_sync` accumulation, a warm-up and cosine LambdaLR, an EMA
  `AveragedModel`, all_reduced meters, rank 0's own checkpoint), ported in 4 lines: a kill in a step and at an epoch's
  end bit-identical under `trainguard verify`.
- accum.py: a trainer with gradient accumulation written blind for torchrun (accum_torchrun.py), whose step loop
  counts from 0 within the epoch: after a mid-epoch restore its extra steps, past the end of the data, are skipped
  (before: exit 0, "lost 0 steps", other weights); accum_vshards.py, its port to virtual shards, shrinks 4 -> 3 exact.
- lr_by_hand.py: written blind, its LR computed from a step counter of its own: with `start_step()` bit-identical;
  without it, the replay audit sees the replayed step's LR differ (before: exit 0, "lost 0 steps", other weights).
- closure.py: `optimizer.step(closure)`, as torch's optimizer docs show it, killed in a step under `trainguard verify`;
  LBFGS, which evaluates its closure several times a step, ends the job at once with exit 78 naming the fix.
- torch's and trainguard's DDP write and read the same `state_dict()` (keys prefixed "module."), so a script's own
  checkpoint loads either way.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import REPO, assert_identical, env, events

from trainguard.exitcodes import EXIT_CONFIG_ERROR

pytestmark = pytest.mark.timeout(300)

JOBS = REPO / "tests" / "jobs"
WORKERS = 3
TEST_LOSS = re.compile(r"Epoch \d+ \| test loss \S+")


def run(script: str, out: Path, args: list[str], faults: str = "", extra_args: tuple = (),
        **extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", str(WORKERS), "--recovery-path",
           str(out / "recovery"), "--hot-spares", "1" if "kill" in faults or extra else "0", *extra_args,
           str(JOBS / script), *args]
    proc = subprocess.run(cmd, cwd=out, env=env(TG_FAULT=faults, **extra), capture_output=True, text=True,
                          timeout=240)
    (out / "launcher.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    return proc


def mingpt(out: Path, faults: str = "", **extra: str) -> tuple[list[dict], list[str]]:
    proc = run("mingpt.py", out, ["--snapshot-path", str(out / "snapshot.pt"), "--final-out", str(out / "final")],
               faults, **extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    states = [torch.load(out / f"final_rank{r}.pt", weights_only=True) for r in range(WORKERS)]
    return states, list(dict.fromkeys(TEST_LOSS.findall(proc.stdout)))


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    states, losses = mingpt(tmp_path_factory.mktemp("uninterrupted"))
    assert len(losses) == 4 and len(set(losses)) == 4, losses  # 4 epochs, each trained
    return states, losses


@pytest.mark.parametrize("faults, collective", [
    ("1:32:kill", ""),  # right after epoch 1's last step (32 steps an epoch): its StepLR step, snapshot, test pass
    ("2:45:kill", ""),  # in the middle of epoch 2
    ("", "0:all_reduce:2"),  # rank 0 inside epoch 2's test-pass all_reduce
])
def test_mingpt_epochs_from_1_kill_9_is_bit_identical(tmp_path, baseline, faults, collective):
    extra = {"TG_FAULT_COLLECTIVE": collective} if collective else {}
    states, losses = mingpt(tmp_path, faults, **extra)
    assert [e for e in events(tmp_path) if e["event"] == "fault_injected"], "the fault did not fire"
    assert_identical(states, baseline[0], "every rank's final state")
    assert losses == baseline[1]
    # a restore at an epoch's end, whose StepLR steps before the next update: torch is not led to warn that the
    # schedule skips its first value (the job's optimizer has stepped)
    assert "before `optimizer.step()`" not in (tmp_path / "launcher.log").read_text()


def test_torchrun_environment_before_the_script_and_after_a_replacement(tmp_path):
    proc = run("torchrun_env.py", tmp_path, [str(tmp_path)], "1:3:kill")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(WORKERS):
        seen = [json.loads(line) for line in (tmp_path / f"env_{rank}.jsonl").read_text().splitlines()]
        first = seen[0]
        assert (first["RANK"], first["ROLE_RANK"], first["LOCAL_RANK"]) == (str(rank),) * 3
        assert (first["WORLD_SIZE"], first["LOCAL_WORLD_SIZE"], first["GROUP_RANK"]) == ("3", "3", "0")
        assert first["MASTER_ADDR"] and first["MASTER_PORT"].isdigit()
        for later in seen[1:]:  # a rewind (same pid) or the replacement: what a torchrun restart gives
            replaced = later["pid"] != first["pid"]
            assert later["TORCHELASTIC_RESTART_COUNT"] == ("1" if replaced else "0")
            assert {k: v for k, v in later.items() if k not in ("pid", "TORCHELASTIC_RESTART_COUNT")} == \
                   {k: v for k, v in first.items() if k not in ("pid", "TORCHELASTIC_RESTART_COUNT")}
    replacement = [json.loads(line)["pid"] for line in (tmp_path / "env_1.jsonl").read_text().splitlines()]
    assert len(set(replacement)) == 2  # rank 1 was replaced


def test_a_kill_inside_an_eval_at_the_top_of_the_loop_that_stepped_a_plateau_scheduler_is_bit_identical(tmp_path):
    """tests/jobs/plateau_eval.py: rank 1 killed at the broadcast of step 21's eval, after ReduceLROnPlateau stepped on
    the validation loss and the early-stop record changed. The survivors go back to step 21 and run the eval again:
    they must take back the scheduler and the record as the step began (before, they kept the eval's moves and made
    them twice: "differs from step 22: scheduler.last_epoch", the LR halved early in a whole run, exit 0)."""
    cmd = [sys.executable, "-m", "trainguard", "verify", "--steps", "40", "--keep", str(tmp_path), "--workers",
           str(WORKERS), "--faults", "at:broadcast:20", str(JOBS / "plateau_eval.py"), "--epochs", "6", "--out", "out.pt"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(TG_EXACT=""), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "kill -9 at a collective (rank 1)  broadcast #20" in proc.stdout and "every run is identical" in proc.stdout
    assert "back to step 21" in (tmp_path / "at-broadcast-20" / "launcher.log").read_text()  # inside that eval


def test_an_imagenet_style_trainer_written_blind_is_bit_identical_after_kills(tmp_path):
    original, port = ((JOBS / name).read_text().split('"""', 2)[2] for name in ("imagenet_style_torchrun.py",
                                                                              "imagenet_style.py"))
    assert "trainguard" not in original  # plain torch
    assert len(set(port.splitlines()) - set(original.splitlines())) == 5  # 3 import lines, tg.Optimizer, start_epoch
    cmd = [sys.executable, "-m", "trainguard", "verify", "--steps", "20", "--keep", str(tmp_path), "--workers",
           str(WORKERS), "--faults", "mid-step,epoch-end", str(JOBS / "imagenet_style.py"), "--epochs",
           "4", "--output-dir", "out"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(TG_EXACT=""), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith(("kill -9", "SIGTERM"))]
    assert len(rows) == 2 and all(" identical" in r for r in rows), proc.stdout  # a kill outside a step: the
    # framework tests' every-fault runs; SIGTERM and a rerun: test_verify.py's example trainer (suite time)


def accum(out: Path, script: str, faults: str = "", *flags: str, workers: int = WORKERS) -> subprocess.CompletedProcess:
    """tests/jobs/`script` for 2 epochs; its final state in OUT/final.pt."""
    out.mkdir()
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", str(workers), "--recovery-path", str(out / "recovery"),
           *flags, str(JOBS / script), "--epochs", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=out, env=env(TG_FAULT=faults), capture_output=True, text=True, timeout=240)
    (out / "launcher.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_blind_accumulation_loop_that_counts_its_steps_from_0_skips_the_steps_past_the_data(tmp_path):
    """tests/jobs/accum.py (written blind for torchrun, ported in 4 lines): after a kill in the middle of an epoch, its
    `for step in range(steps_per_epoch)` makes more steps than the resumed loader has batches; they have none and
    are skipped, their scheduler steps undone. Before, the run ended with exit 0, "lost 0 steps" and other weights
    (8 extra LR-scheduler steps in that epoch)."""
    original, port = ((JOBS / name).read_text().split('"""', 2)[2] for name in ("accum_torchrun.py", "accum.py"))
    assert "trainguard" not in original
    assert len(set(port.splitlines()) - set(original.splitlines())) == 6  # 3 import lines, init, Optimizer, start_epoch
    accum(tmp_path / "uninterrupted", "accum.py")
    for fault in ("1:8:kill", "2:28:kill-forward"):  # in epoch 0 (20 steps an epoch on 3 workers), and in the last one
        proc = accum(tmp_path / fault, "accum.py", fault)
        assert "after the training loader's pass over epoch" in proc.stderr and "skipped" in proc.stderr
        assert_identical(torch.load(tmp_path / "uninterrupted" / "final.pt"), torch.load(tmp_path / fault / "final.pt"),
                         fault)


def test_an_lr_computed_from_the_scripts_own_step_counter(tmp_path):
    """tests/jobs/lr_by_hand.py (written blind; its LR computed from a `global_step` it keeps): ported with
    `global_step = tg.start_step()`, a kill -9 mid-epoch ends bit-identical. Ported without it (the counter starts
    again from 0 after the restore, so does the warm-up), the replay audit sees the replayed step's LR differ: under
    --exact strict the job ends with exit 80 naming start_step. Before, that run ended with exit 0, "lost 0 steps"
    and other weights."""
    original, port = ((JOBS / name).read_text().split('"""', 2)[2] for name in ("lr_by_hand_torchrun.py",
                                                                              "lr_by_hand.py"))
    assert "trainguard" not in original
    assert len(set(port.splitlines()) - set(original.splitlines())) == 7  # 3 imports, Optimizer (2), start_*
    naive = tmp_path / "lr_naive.py"
    naive.write_text((JOBS / "lr_by_hand.py").read_text().replace("global_step = tg.start_step()", "global_step = 0"))

    def train(out: Path, script: Path, faults: str = "") -> subprocess.CompletedProcess:
        out.mkdir()
        cmd = [sys.executable, "-m", "trainguard", "run", "--workers", str(WORKERS), "--recovery-path",
               str(out / "recovery"), str(script), "--epochs", "3", "--out", str(out)]
        return subprocess.run(cmd, cwd=out, env=env(TG_FAULT=faults), capture_output=True, text=True, timeout=240)

    for proc in (train(tmp_path / "uninterrupted", JOBS / "lr_by_hand.py"),
                 train(tmp_path / "killed", JOBS / "lr_by_hand.py", "1:40:kill")):
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert_identical(torch.load(tmp_path / "uninterrupted" / "final.pt"), torch.load(tmp_path / "killed" / "final.pt"))
    proc = train(tmp_path / "naive", naive, "1:40:kill")
    assert proc.returncode == 80, proc.stderr[-3000:]
    assert "with other hyperparameters" in proc.stderr and "global_step = trainguard.start_step()" in proc.stderr


def test_the_blind_accumulation_loop_on_virtual_shards_shrinks_from_4_to_3_bit_identical(tmp_path):
    """tests/jobs/accum_vshards.py on 12 virtual shards: rank 1 killed and replaced at step 8, rank 2 killed at step
    16 with no restart left (4 -> 3 workers): every tensor equal to an uninterrupted run on 4 workers."""
    accum(tmp_path / "uninterrupted", "accum_vshards.py", "", "--virtual-shards", "12", workers=4)
    accum(tmp_path / "shrunk", "accum_vshards.py", "1:8:kill,2:16:kill", "--virtual-shards", "12", "--recover-strategy",
          "elastic", "--elastic-deadline", "1", "--max-restarts", "1", workers=4)
    worlds = [e["world_size"] for e in events(tmp_path / "shrunk") if e["event"] == "generation_formed"]
    assert worlds[0] == 4 and worlds[-1] == 3, worlds
    assert_identical(torch.load(tmp_path / "uninterrupted" / "final.pt"), torch.load(tmp_path / "shrunk" / "final.pt"),
                     "4 -> 3")


def test_a_trainer_that_steps_with_a_closure_is_bit_identical(tmp_path):
    """`optimizer.step(closure)`, as torch's optimizer docs show it: the closure's backward is the step's gradient
    exchange, so it runs before the update is committed or skipped (before, the optimizer's step hooks decided first
    and a kill in the exchange ended in other weights, silently)."""
    proc = subprocess.run([sys.executable, "-m", "trainguard", "verify", "--steps", "40", "--keep", str(tmp_path),
                           "--workers", str(WORKERS), "--faults", "mid-step", str(JOBS / "closure.py"), "3"],
                          cwd=tmp_path, env=env(TG_EXACT=""), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("kill -9")]
    assert len(rows) == 1 and " identical" in rows[0], proc.stdout


def test_lbfgs_under_the_commit_point_is_refused_at_once_naming_the_fix(tmp_path):
    proc = run("closure.py", tmp_path, ["1"], CLOSURE_OPTIMIZER="lbfgs")
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "torch.optim.LBFGS evaluates its closure several times" in proc.stderr, proc.stderr[-3000:]
    assert "restarting worker" not in proc.stderr


def test_torch_and_trainguard_ddp_checkpoints_load_either_way(tmp_path):
    import torch.distributed as dist

    import trainguard as tg

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        theirs = torch.nn.parallel.DistributedDataParallel(net())
        ours = tg.DDP(net())
        assert list(ours.state_dict()) == list(theirs.state_dict())  # module.0.weight, ...
        with torch.no_grad():
            theirs.module[0].weight.add_(1.0)
        ours.load_state_dict(theirs.state_dict())  # torch's checkpoint into trainguard's wrapper
        theirs.load_state_dict(ours.state_dict())  # and back
        assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))
    finally:
        dist.destroy_process_group()
