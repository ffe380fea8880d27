"""Desyncs and hangs (control/waits.py, control/watch.py, worker/ledger.py), with real processes.

A desync is a script bug: ranks that call collectives that do not match. It must end the job within 10 s of
the mismatch, name both calls (file:line), record the event, and exit EXIT_DESYNC (79), never 0, whether gloo
waits (another operation: until its timeout) or aborts a rank at once (another size, a skipped call). A hang
(a rank stuck in its own code while its peers wait) is a fault: its stacks are printed, it is replaced, and
the job ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import REPO, assert_identical, env, events, wait_for

from trainguard.control.waits import END_OF_SCRIPT, Waiting, find_desync, find_hang, mismatch, rewind_first
from trainguard.exitcodes import EXIT_DESYNC
from trainguard.worker.hang import left_behind

pytestmark = pytest.mark.timeout(240)

DESYNC_JOB, HANG_JOB = REPO / "tests" / "jobs" / "desync.py", REPO / "tests" / "jobs" / "hang.py"


def run(out: Path, script: Path, *args: str, flags: tuple = (),
        extra: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "trainguard", "run", "--workers", "3", "--recovery-path",
                           str(out / "recovery"), *flags, str(script), *args],
                          cwd=REPO, env=env(**(extra or {})), capture_output=True, text=True, timeout=200)
    (out / "launcher.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    return proc, time.monotonic() - t0


def line_of(text: str) -> int:
    return next(i for i, ln in enumerate(DESYNC_JOB.read_text().splitlines(), 1) if text in ln)


# mode -> the two calls the verdict must name
CALLS = {
    "op": ("dist.broadcast(flag, 0)", "dist.all_reduce(flag)"),  # gloo waits until its timeout
    "shape": ("dist.all_reduce(flag)", "dist.all_reduce(flag)"),  # gloo aborts a rank (SIGABRT) at once
    "skip": ("loss.backward()", "dist.all_reduce(flag)"),  # rank 1's next step pairs with the flag's call
    "end": ("loss.backward()", None),  # rank 1 ran its script to the end while the others wait
}


@pytest.mark.parametrize("mode", list(CALLS))
def test_collectives_that_do_not_match_end_the_job_naming_both_calls(tmp_path, mode):
    proc, took = run(tmp_path, DESYNC_JOB, mode, str(tmp_path))
    log = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_DESYNC, log[-4000:]
    assert "rank 0: done" not in log and "rank 2: done" not in log  # they never went on as if nothing happened
    desyncs = [e for e in events(tmp_path) if e["event"] == "desync"]
    assert len(desyncs) == 1 and desyncs[0]["action"] == "end", desyncs
    mismatch_at = float((tmp_path / "mismatch_at").read_text())
    assert desyncs[0]["ts"] - mismatch_at < 10, f"declared {desyncs[0]['ts'] - mismatch_at:.1f} s after the mismatch"
    for call in CALLS[mode]:
        if call is not None:
            assert f"desync.py:{line_of(call)}" in desyncs[0]["detail"], (call, desyncs[0]["detail"])
    if mode == "end":
        assert "has run its script to the end" in desyncs[0]["detail"]
    if mode == "op":  # every rank learnt of it while its run was alive: the committed state is saved, to resume from
        saved = [e for e in events(tmp_path) if e["event"] == "stopped_on_fault" and e.get("saved")]
        assert sorted(e["rank"] for e in saved) == [0, 1, 2], saved
    assert "trainguard: desync: the ranks called collectives that do not match" in proc.stderr
    assert "Likely cause" in proc.stderr


def test_ranks_whose_updates_part_end_the_job_naming_them_and_the_fix(tmp_path):
    """Rank 1 skips one optimizer.step() after its backward, as a script does that decides on one rank's own loss. The
    exchanges still pair one to one, so nothing hung or failed: the job exited 0 with the replicas parted. Each rank's
    committed step now rides in the exchange beside its stop vote (train/engine/lockstep.py)."""
    proc, _ = run(tmp_path, DESYNC_JOB, "update", str(tmp_path))
    log = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_DESYNC, log[-4000:]
    assert "done" not in proc.stdout, log[-4000:]
    desyncs = [e for e in events(tmp_path) if e["event"] == "desync"]
    assert desyncs and all(e["action"] == "end" for e in desyncs), desyncs
    assert "rank(s) [1] had made fewer optimizer steps than rank(s) [0, 2]" in desyncs[0]["detail"], desyncs
    assert "decide from a value every rank shares" in proc.stderr, log[-4000:]


def test_the_stop_vote_and_the_committed_step_share_a_slot_exactly():
    from trainguard.train.engine import lockstep

    values = [lockstep.control(signum, step) for signum, step in ((0, 7), (15, 7), (0, 7 + lockstep.CYCLE))]
    assert all(v < 2 ** 24 and float(torch.tensor(float(v), dtype=torch.float32)) == v for v in values)
    assert lockstep.stop_vote(values) == 15 and lockstep.parted(values) is None  # the same step, modulo CYCLE
    assert lockstep.control(10, lockstep.CYCLE - 1) < 2 ** 24
    assert "rank(s) [1] had made fewer" in lockstep.parted([lockstep.control(0, 8), lockstep.control(0, 7)])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    want, _ = run(out, HANG_JOB, str(out / "final"))
    assert want.returncode == 0, want.stderr[-3000:]
    return out / "final"


def assert_as_uninterrupted(final: Path, want: Path) -> None:
    for r in range(3):
        assert_identical(torch.load(final / f"rank_{r}.pt", weights_only=True),
                         torch.load(want / f"rank_{r}.pt", weights_only=True), f"rank {r}")


def test_a_rank_stuck_in_its_own_code_is_replaced_and_the_job_ends_bit_identical(tmp_path, uninterrupted):
    proc, took = run(tmp_path / "hung", HANG_JOB, str(tmp_path / "hung" / "final"), "stuck",
                     flags=("--hang-timeout", "3"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "this worker is hung: rank 1 made no progress" in proc.stderr
    assert "in stuck_in_user_code" in proc.stderr  # its own stack, from faulthandler
    assert [e["rank"] for e in events(tmp_path / "hung") if e["event"] == "hang_detected"] == [1]
    assert "recovery 1:" in proc.stdout
    assert took < 90  # the sleep was 600 s
    assert_as_uninterrupted(tmp_path / "hung" / "final", uninterrupted)


@pytest.mark.parametrize("mode", ["side", "side-untracked"])
def test_a_rank_left_waiting_on_a_live_peer_that_went_back_is_freed(tmp_path, uninterrupted, mode):
    """Rank 2 is killed; rank 0's collective with it fails and rank 0 goes back to its commit, while rank 1 waits
    for rank 0 on a group of the script's own (tests/jobs/hang.py). Made with torch's `new_group`, its connections
    are cut with the generation's at once. Made where trainguard did not see it, rank 1 would wait the backend's
    whole timeout (120 s): the left-behind watchdog prints its stacks and replaces it after 10 s instead."""
    # the side channel comes after the update, so rank 0's reduce that fails is code the run after skips: the replay
    # audit says so (tests/test_audit.py), and warns here, where the weights are the point
    proc, took = run(tmp_path, HANG_JOB, str(tmp_path / "final"), mode, extra={"TG_FAULT": "2:5:kill", "TG_EXACT": "warn"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "the code after step 5's update" in proc.stdout, proc.stdout[-3000:]
    left_behind = "still waits" in proc.stderr and "in <module>" in proc.stderr  # its message, then its stack
    assert left_behind == (mode == "side-untracked"), proc.stderr[-4000:]
    assert took < 90, proc.stderr[-4000:]
    assert_as_uninterrupted(tmp_path / "final", uninterrupted)


def test_without_a_hang_timeout_a_slow_rank_is_left_alone():
    """Hang detection is off by default: a rank computing for long while its peers wait is no fault."""
    waits = {0: point(seq=3, for_s=100.0)}
    assert find_hang({1: 1000.0}, waits, None, 3.0) is None
    assert find_hang({1: 1000.0}, waits, 600.0, 3.0) == (1, 1000.0)
    assert find_hang({1: 10.0}, waits, 600.0, 3.0) is None
    assert find_hang({1: 1000.0}, {}, 600.0, 3.0) is None  # nobody waits for it


# --- the decisions (pure) --------------------------------------------------------------------------------


def point(seq: int, op: str = "all_reduce", shape: str = "float32[4]", group: str = "", for_s: float = 5.0,
          generation: int = 1, site: str = "train.py:10") -> Waiting:
    return Waiting(generation=generation, group=group, seq=seq, op=op, shape=shape, site=site, for_s=for_s)


def test_ranks_at_the_same_collective_agree_and_a_moment_apart_are_no_desync():
    assert find_desync({0: point(7), 1: point(7), 2: point(7)}, [], 3.0) is None
    assert find_desync({0: point(7, for_s=1.0), 1: point(8, for_s=0.5)}, [], 3.0) is None  # a race, not yet a wait
    assert find_desync({0: point(7, group="1"), 1: point(9, group="2")}, [], 3.0) is None  # other groups
    assert find_desync({0: point(7, generation=1), 1: point(9, generation=2)}, [], 3.0) is None
    uneven = {0: point(4, op="all_to_all_single", shape=""), 1: point(4, op="all_to_all_single", shape="")}
    assert find_desync(uneven, [], 3.0) is None


def test_another_op_another_shape_a_skipped_call_and_an_ended_script_are_desyncs():
    op = find_desync({0: point(7), 1: point(7, op="broadcast", site="train.py:12")}, [], 3.0)
    assert op is not None and op.ranks == (0, 1) and "train.py:10" in op.text and "train.py:12" in op.text
    at_once = {0: point(7, for_s=0.6), 1: point(7, shape="float32[8]", for_s=0.6)}  # no timing makes it legitimate
    assert find_desync(at_once, [], 5.0) is not None
    assert mismatch({1: point(7, shape="float32[8]", for_s=0.0), 2: point(7, for_s=0.0)}) is not None  # failures
    skipped = find_desync({0: point(7), 2: point(8)}, [], 3.0)
    assert skipped is not None and "skipped" in skipped.text
    ended = find_desync({0: point(13), 1: point(13, op=END_OF_SCRIPT, shape="")}, [], 3.0)
    assert ended is not None and "run its script to the end" in ended.text
    finished = find_desync({0: point(13)}, [1], 3.0)
    assert finished is not None and "finished" in finished.text


def test_a_hostile_wait_report_is_refused():
    from pydantic import ValidationError

    for bad in (dict(site="a\nforged line"), dict(seq=-1), dict(for_s=float("nan")), dict(op="x" * 1000)):
        with pytest.raises(ValidationError):
            Waiting(**{**point(1).model_dump(), **bad})


def test_a_desync_after_a_recovery_is_rewound_once_a_step_and_one_before_any_ends_the_job():
    assert not rewind_first(1, 5, None)  # the job's first generation: the script's own bug
    assert rewind_first(2, 5, None)  # after a recovery: the ranks may have come back disagreeing
    assert not rewind_first(3, 5, 5)  # again at the same step: the rewind did not help
    assert rewind_first(3, 9, 5)


def test_a_thread_is_left_behind_only_once_it_has_waited_the_limit_since_it_knew():
    assert left_behind(now=20.0, news_at=10.0, blocked_since=5.0, limit=10.0)  # blocked before the news: 10 s after it
    assert not left_behind(now=19.0, news_at=10.0, blocked_since=5.0, limit=10.0)
    assert not left_behind(now=20.0, news_at=10.0, blocked_since=15.0, limit=10.0)  # blocked after: 10 s from then
    assert not left_behind(now=99.0, news_at=10.0, blocked_since=None, limit=10.0)  # in no collective: never


def test_a_rank_left_blocked_in_a_cut_generation_shows_the_desync_a_failure_report_alone_does_not(tmp_path):
    """gloo aborts the rank that received the larger tensor (rank 0 here); rank 2's collective fails, but rank 1,
    which sent it, stays blocked in generation 1 while the job moves on. Its heartbeats say where: that wait,
    against rank 2's failure at the same collective, is the desync (it was once taken for a fault and the job
    ended on the audit instead, exit 80)."""
    from test_cluster_errors import LiveScheduler, join_all
    from trainguard.control import protocol as p
    from trainguard.control.client import Connection

    cl = LiveScheduler(tmp_path, workers=3)
    try:
        (c0, hb0), (c1, _), (c2, _) = (cl.worker(str(i), 100 + i) for i in range(3))
        join_all((c0, 0), (c1, 0), (c2, 0))
        cl.die(hb0, "0")  # aborted by gloo
        conn = Connection(cl.address, timeout=5)
        try:
            failed = p.ReportFailure(node_id="2", incarnation=1, generation=1, kind=p.FailureKind.COLLECTIVE,
                                     detail="Connection closed by peer", at=point(7, for_s=0.0))
            conn.request(failed, 5)
            assert not [e for e in cl.events() if e["event"] == "desync"]  # one report alone shows nothing
            blocked = p.Heartbeat(node_id="1", incarnation=1, generation=1, step=6,
                                  waiting=point(7, shape="float32[8]", site="train.py:11"))
            conn.request(blocked, 5)
        finally:
            conn.close()
        wait_for(lambda: [e for e in cl.events() if e["event"] == "desync"], 10, "the desync event")
        desync = next(e for e in cl.events() if e["event"] == "desync")
        assert desync["action"] == "end" and sorted(desync["ranks"]) == [1, 2], desync
        assert "float32[8]" in desync["detail"] and "train.py:11" in desync["detail"], desync
    finally:
        cl.close()
