"""The commit-or-skip protocol (docs/ARCHITECTURE.md's table) with real processes, 3 and 4 workers
(with 2 ranks every summation order gives the same bits, so order bugs would not show). These also
stand for the 3- and 4-worker cases of SIGSTOP, a scheduler kill and two ranks killed at once;
tests/test_recovery.py keeps the 2-worker cases.

A kill -9 lands at a chosen point of a step: before the gradient exchange, while it is in flight,
after it completed but before the update, and after the update but before the step is counted.
Each job must end with every model, optimizer, LR-scheduler and RNG tensor equal (torch.equal)
to an uninterrupted run's.
"""

from __future__ import annotations

import pytest
from harness import assert_identical, events, finals, launch

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def baseline(baseline_runs):
    return baseline_runs


def check(out, workers, expected, proc) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = finals(out, workers)
    for rank in range(workers):
        assert_identical(got[rank], expected[rank], f"rank {rank}")


def restores(out) -> list[dict]:
    return [e for e in events(out) if e["event"] == "restore_step" and not e.get("fresh")]


def test_kill_before_in_and_after_the_exchange_and_in_the_commit_3_workers(tmp_path, baseline):
    faults = "1:3:kill-before,2:7:kill-exchange,0:11:kill-after,1:15:kill-commit:2"
    proc = launch(tmp_path, 3, faults=faults, max_restarts=6, timeout=240)
    check(tmp_path, 3, baseline(3), proc)
    done = restores(tmp_path)
    assert len(done) == 4, done
    assert all(r["to_step"] == r["from_step"] for r in done)  # survivors never lose a step
    injected = [e["how"] for e in events(tmp_path) if e["event"] == "fault_injected"]
    assert injected == ["kill-before", "kill-exchange", "kill-after", "kill-commit"]


def test_sigstop_then_scheduler_kill_3_workers(tmp_path, baseline):
    proc = launch(tmp_path, 3, faults="2:5:stop,0:12:sched", timeout=240)
    check(tmp_path, 3, baseline(3), proc)
    assert any(e["event"] == "failure_detected" and e["kind"] == "heartbeat" for e in events(tmp_path))
    assert "restarting scheduler" in proc.stdout + proc.stderr
    assert len(restores(tmp_path)) == 1  # the stopped worker's; the scheduler's death costs no recovery


def test_two_killed_in_the_exchange_then_one_after_its_update_4_workers(tmp_path, baseline):
    proc = launch(tmp_path, 4, faults="1:4:kill-exchange,3:4:kill-exchange,2:10:kill-commit", level="high",
                  max_restarts=6, timeout=240)
    check(tmp_path, 4, baseline(4, "high"), proc)
    assert len(restores(tmp_path)) >= 2
