"""The replay audit (train/engine/audit.py), with real processes and real kill -9: a step a surviving rank
runs again after a fault is compared with its first run. Two trainers carry state trainguard cannot see: a
generator of their own (tests/test_verify.py: warned about, a `replay_mismatch` event, `trainguard report`, and
the launcher's recovery line says "NOT bit-identical from step N", not "lost 0 steps"), and a plain counter on
the model (here). Code after `optimizer.step()` that a fault interrupts (an eval's all_reduce) is skipped by the run
after when the loop resumes past it: said, and exit 80 under strict; the same eval at the top of the iteration runs
again, with no alarm (tests/jobs/cycle.py). Under --exact strict the job ends with
EXIT_NOT_EXACT and the committed state's dying gasp, which the same command resumes from. Every other test
job runs with TG_EXACT=strict (harness.FAST): an exact trainer never raises a false alarm."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import REPO, env, events

from trainguard.exitcodes import EXIT_NOT_EXACT
from trainguard.train.engine.audit import mark, marks, same

pytestmark = pytest.mark.timeout(240)

JOBS = REPO / "tests" / "jobs"


def run(out: Path, job: str, *, exact: str, fault: str = "1:5:kill-exchange") -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "trainguard", "run", "--workers", "3", "--recovery-path",
                           str(out / "recovery"), "--exact", exact, str(JOBS / f"{job}.py"), str(out / "final")],
                          cwd=REPO, env=env(TG_FAULT=fault), capture_output=True, text=True, timeout=200)
    (out / "launcher.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    return proc


def test_a_counter_the_model_keeps_ends_the_job_under_strict_with_a_checkpoint_to_resume_from(tmp_path):
    proc = run(tmp_path, "attr_counter", exact="strict")
    assert proc.returncode == EXIT_NOT_EXACT, proc.stderr[-4000:]
    found = [e for e in events(tmp_path) if e["event"] == "replay_mismatch"]
    assert found and found[0]["what"] == "output", found  # the same batch, another result
    assert "differs from its first run" in proc.stderr and "register_state" in proc.stderr
    assert "not bit-identical: a step replayed after a fault differed from its first run" in proc.stderr
    gasps = [e for e in events(tmp_path) if e["event"] == "stopped_on_fault" and e.get("saved")]
    assert gasps, "no dying gasp of the committed state"
    again = run(tmp_path, "attr_counter", exact="strict", fault="")  # the same command: resumes from it
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resumed at step" in again.stdout + again.stderr


def test_a_fingerprint_compares_bits():
    nan = torch.tensor([float("nan"), 1.0])
    assert same(marks([nan]), marks([nan.clone()]))  # NaN is equal to itself, bit for bit
    assert not same(marks([torch.tensor([0.0])]), marks([torch.tensor([-0.0])]))
    assert not same(marks([torch.ones(4)]), marks([torch.ones(5)]))
    assert not same(marks([torch.ones(4)]), marks([torch.ones(4, dtype=torch.float64)]))
    big = torch.arange(10_000_000, dtype=torch.float32)
    assert len(mark(big).sample) <= 4 * 1024  # about a thousand elements' bytes, whatever the size
    changed = big.clone()
    changed[::9765] += 1  # touches the sampled elements
    assert not same(marks({"x": big}), marks({"x": changed}))


@pytest.mark.parametrize("where", ["after", "before"])
def test_an_eval_interrupted_after_the_update_is_said_to_be_skipped_unless_the_loop_runs_it_again(tmp_path, where):
    """A kill of rank 1 in the eval's all_reduce after step 4 (the first collective outside a step)."""
    proc = subprocess.run([sys.executable, "-m", "trainguard", "run", "--workers", "3", "--recovery-path",
                           str(tmp_path / "recovery"), "--exact", "strict", str(JOBS / "cycle.py"), "--max-steps", "9",
                           "--eval", where, "--out", str(tmp_path / "out")],
                          cwd=tmp_path, env=env(TG_FAULT_COLLECTIVE="1:all_reduce:1"), capture_output=True, text=True,
                          timeout=200)
    (tmp_path / "launcher.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert [e["event"] for e in events(tmp_path) if e["event"] == "fault_injected"], proc.stderr[-3000:]
    found = [e for e in events(tmp_path) if e["event"] == "replay_mismatch"]
    if where == "before":  # nanoGPT's place: the eval of step 4 runs again, and prints its line
        assert proc.returncode == 0 and not found, proc.stderr[-3000:]
        assert proc.stdout.count("eval after step 4:") >= 1 and "eval after step 8:" in proc.stdout
        return
    assert proc.returncode == EXIT_NOT_EXACT, proc.stderr[-3000:]
    assert found and {(e["what"], e["step"], e["forward"], e["again"]) for e in found} == {("tail", 4, 1, 0)}, found
    assert "the loop resumed past that code, so for step 4 it did not run again" in proc.stdout + proc.stderr
