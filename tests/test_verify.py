"""`trainguard verify` (launch/verify.py, train/engine/probe.py): the user's own script, run N committed steps
without a fault and once per fault, every tensor of every rank's state compared. On examples/trainer.py every
row is identical (exit 0); on a script with a generator of its own it names the first differing step and tensor
and the audit's diagnosis (exit 1). Each run has its own working directory: the script's snapshot, a relative
path, is written in each and read by none of the others."""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness import REPO, env, events

from trainguard.launch.verify import Case, plan, run_flags

pytestmark = pytest.mark.timeout(400)


def verify(*args: str, timeout: float = 360, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainguard", "verify", *args], cwd=cwd, env=env(TG_EXACT=""),
                          capture_output=True, text=True, timeout=timeout)


def test_the_example_trainer_is_identical_after_a_sigterm_and_a_rerun(tmp_path):
    """One fault, the one that goes through disk (tests/test_accelerate.py and test_transformers.py run verify with
    every other; tests/test_real_trainer.py kills this trainer at every moment). The folder to keep is given
    relative to where verify is started, as a user types it (each run has its own working directory)."""
    proc = verify("--steps", "14", "--faults", "sigterm", "--keep", "kept", "--workers", "3",
                  str(REPO / "examples/trainer.py"), "--epochs", "2", cwd=tmp_path)
    tmp_path = tmp_path / "kept"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if "(rank 1)" in ln]
    assert [r.split("(rank 1)")[0].strip() for r in rows] == ["SIGTERM and a rerun"], proc.stdout
    assert all("identical" in r and "differs" not in r for r in rows), proc.stdout
    assert "every run is identical to the one without a fault" in proc.stdout
    for run in ("clean", "sigterm"):  # its own snapshot.pt, in its own directory
        assert (tmp_path / run / "snapshot.pt").exists()
    assert not (REPO / "snapshot.pt").exists()


def test_a_script_with_state_of_its_own_is_named_with_its_first_differing_step_and_tensor(tmp_path):
    """tests/jobs/own_generator.py draws its batches from an iterator of its own. verify names the first differing
    step and tensor; in the faulty run itself the replay audit (warn) said so at once, with the cause and the fix,
    and the launcher's recovery line and `trainguard report` say "NOT bit-identical", not "lost 0 steps"."""
    proc = verify("--steps", "8", "--faults", "mid-step", "--keep", str(tmp_path), "--workers", "3",
                  "tests/jobs/own_generator.py", str(tmp_path / "out"))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = next(ln for ln in proc.stdout.splitlines() if ln.startswith("kill -9 in a step"))
    assert "differs from step 5 (at step 8, first in each part: rank " in row, row  # the first differing step
    assert "rank 0: model.0.bias)" in row, row  # and the tensor of each part that differs, at the last step
    assert "NOT bit-identical from step 4: the inputs of rank" in row, row  # the replay audit's diagnosis
    assert "NOT identical" in proc.stdout
    run = tmp_path / "mid-step"
    found = [e for e in events(run) if e["event"] == "replay_mismatch"]
    assert found and {e["what"] for e in found} == {"inputs"} and {e["step"] for e in found} == {4}, found
    rank = found[0]["rank"]
    assert rank in (0, 2)  # a survivor: the killed rank's replacement has no first run to compare with
    log = (run / "launcher.log").read_text()
    assert f"the inputs of rank {rank}'s training forward 1 at step 4 differ from its first run" in log
    assert "a data iterator or counter of the script's own" in log  # the likely cause, and the fix
    assert "NOT bit-identical from step 4" in log and "lost 0 steps" not in log
    report = subprocess.run([sys.executable, "-m", "trainguard", "report", str(run / "recovery")], cwd=REPO,
                            capture_output=True, text=True, timeout=60, check=True).stdout
    assert "NOT bit-identical from step 4" in report


def test_a_generator_of_the_scripts_own_drawn_at_every_step_is_exact(tmp_path):
    """The same trainer drawing each step's batch from its own torch.Generator (OWN_DRAW=generator): trainguard keys
    the script's generators at every commit, so the replayed steps draw the batches they drew the first time (it
    used to differ from the step the job went back to, as the iterator does). The epoch-end fault asked for does not
    come within 6 steps: verify says so and exits 1 (it used to end "every run is identical", exit 0: a blind port's
    finding), and so does a collective fault past the run's end (a blind SimCLR port's `at:all_reduce:99999`)."""
    proc = subprocess.run([sys.executable, "-m", "trainguard", "verify", "--steps", "6", "--faults",
                           "mid-step,epoch-end,at:all_reduce:99999", "--workers", "3", "tests/jobs/own_generator.py", str(tmp_path / "o")],
                          cwd=REPO, env=env(OWN_DRAW="generator"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "  kill -9 in a step: identical" in proc.stdout, proc.stdout[-3000:]
    assert "not run: epoch-end (no epoch ended within 6 steps)" in proc.stdout
    assert "NOT verified: epoch-end asked for and not run; give a larger --steps" in proc.stdout
    assert "  kill -9 at a collective: the fault never came: all_reduce #99999 is not in the run's first 6" in proc.stdout
    assert "NOT verified: see the rows above" in proc.stdout and "every run is identical" not in proc.stdout


def test_bad_flags_are_refused_before_anything_runs():
    for args, said in ((["--faults", "meteor", "examples/trainer.py"], "--faults: unknown ['meteor']"),
                       (["--steps", "2", "examples/trainer.py"], "at least 4 committed steps"),
                       (["--steps", "many", "examples/trainer.py"], "invalid int value: 'many'")):
        proc = verify(*args, timeout=60)
        assert proc.returncode == 2 and said in proc.stderr, (args, proc.stderr)


def test_the_faults_follow_what_the_clean_run_saw():
    argv = ["verify", "--workers", "3", "--steps=20", "--recovery-path", "/r", "--keep", "/k", "train.py", "--steps", "7"]
    assert run_flags(argv, ["--steps", "7"]) == ["--workers", "3"]  # the script's own --steps stays its own
    cases = plan({"outside": ["barrier", 2, 12], "epoch_end": 12}, 20, 1, ["mid-step", "outside", "epoch-end"])
    assert [c.env for c in cases] == [{"TG_FAULT": "1:10:kill-forward"}, {"TG_FAULT_COLLECTIVE": "1:barrier:2"},
                                      {"TG_FAULT": "1:12:kill"}]
    assert [c.before for c in cases] == [9, 12, 12]  # the last step committed before each fault
    assert plan({"outside": None, "epoch_end": 30}, 20, 1, ["outside", "epoch-end"]) == []  # neither happened
    assert plan({}, 20, 0, ["sigterm"]) == [Case("sigterm", "after step 10 (stops at the next commit), then the same "
                                                  "command again", {"TG_FAULT": "0:10:term"}, rerun=True, before=10)]
    assert plan({}, 20, 1, ["scheduler"]) == [Case("scheduler", "right after step 10", {"TG_FAULT": "1:10:sched"},
                                                   before=10)]


def test_a_script_that_is_not_reproducible_is_told_apart_from_a_fault(tmp_path):
    """Seeded from the OS, no two runs make the same steps: the row says the runs differ before the fault."""
    proc = subprocess.run([sys.executable, "-m", "trainguard", "verify", "--steps", "6", "--faults", "after-commit",
                           "--keep", str(tmp_path), "--workers", "3", "tests/jobs/own_generator.py", str(tmp_path / "o")],
                          cwd=REPO, env=env(TG_EXACT="", OWN_SEED="urandom"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = next(ln for ln in proc.stdout.splitlines() if ln.startswith("kill -9 after a commit"))
    assert "differs from step 1 (" in row and "before the fault: the script does not make the same steps twice" in row, row


def test_a_run_with_the_same_tensors_whose_audit_speaks_is_a_difference(tmp_path):
    """A logged all_reduce after the update, killed from inside: the run after the fault resumes past it, so every
    tensor is the same but that step's eval line never comes. verify says so and exits 1 (it used to print "every run
    is identical" and exit 0 beside the audit's warning: a blind port's finding)."""
    proc = subprocess.run([sys.executable, "-m", "trainguard", "verify", "--steps", "8", "--faults", "outside",
                           "--workers", "3", "--keep", str(tmp_path), str(REPO / "tests" / "jobs" / "cycle.py"),
                           "--max-steps", "9", "--eval", "after"], cwd=tmp_path, env=env(TG_EXACT=""), capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = next(ln for ln in proc.stdout.splitlines() if ln.startswith("kill -9 outside a step"))
    assert "same state, audit differs" in row and "did not run again" in row, proc.stdout
    assert "every run is identical" not in proc.stdout


def test_a_difference_is_named_in_each_part_of_the_state():
    """A lost update differs in the model and the optimizer; verify named only `extra.model_ema...` (first in sorted
    order), so a blind timm port's report read as an EMA problem."""
    import torch

    from trainguard.launch.verify import differences

    a = {"model": {"w": torch.ones(2)}, "optimizer": {"state": {0: {"m": torch.ones(1)}}},
         "extra": {"ema": {"x": torch.zeros(1)}, "meter": {"n": 1}}}
    b = {"model": {"w": torch.zeros(2)}, "optimizer": {"state": {0: {"m": torch.zeros(1)}}},
         "extra": {"ema": {"x": torch.ones(1)}, "meter": {"n": 1}}}
    assert differences(a, b) == "extra.ema.x, model.w, optimizer.state.0.m"
    assert differences(a, a) is None
