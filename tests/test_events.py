import itertools
import threading

import pytest

from trainguard.errors import ConfigError, TrainguardError
from trainguard.obs.events import EventLog, summarize_recovery

pytestmark = pytest.mark.timeout(30)


def fake_clock(start=100.0):
    counter = itertools.count()
    return lambda: start + next(counter)


def test_write_read_and_append(tmp_path):
    path = tmp_path / "sub" / "events.jsonl"
    with EventLog(path, clock=fake_clock()) as log:
        rec = log.emit("step_finished", generation=1, step=3)
        log.emit("odd", value={1, 2} and object())  # not JSON: written as str
    assert rec == {"ts": 100.0, "event": "step_finished", "generation": 1, "step": 3}
    with EventLog(path, durable=True, clock=fake_clock(200.0)) as log:
        log.emit("restored", generation=2, rank=0, source="peer")
    events = EventLog.read(path)
    assert [e["event"] for e in events] == ["step_finished", "odd", "restored"]
    assert events[0] == rec and isinstance(events[1]["value"], str) and events[2]["ts"] == 200.0
    assert path.read_text().count("\n") == 3


def test_real_clock_and_bad_fields(tmp_path):
    log = EventLog(tmp_path / "e.jsonl")
    assert isinstance(log.emit("x")["ts"], float)
    with pytest.raises(ConfigError):
        log.emit("x", ts=1.0)
    with pytest.raises(ConfigError):
        log.emit("")
    log.close()
    with pytest.raises(TrainguardError, match="closed"):
        log.emit("x")


def test_torn_last_line_skipped_and_repaired(tmp_path):
    path = tmp_path / "e.jsonl"
    with EventLog(path, clock=fake_clock()) as log:
        log.emit("a", n=1)
        log.emit("b", n=2)
    with open(path, "ab") as f:
        f.write(b'{"ts": 5.0, "event": "c", "n"')  # a writer died mid-line
    assert [e["event"] for e in EventLog.read(path)] == ["a", "b"]
    with EventLog(path, clock=fake_clock()) as log:  # reopening ends the torn line first
        log.emit("d")
    assert [e["event"] for e in EventLog.read(path)] == ["a", "b", "d"]


def test_threads_do_not_interleave(tmp_path):
    path = tmp_path / "e.jsonl"
    log = EventLog(path)

    def work(t):
        for i in range(200):
            log.emit("step_finished", thread=t, step=i, pad="x" * 300)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    events = EventLog.read(path)
    assert len(events) == 800
    for t in range(4):
        assert [e["step"] for e in events if e["thread"] == t] == list(range(200))


def test_null_log(tmp_path):
    log = EventLog.null()
    assert log.emit("x", a=1)["a"] == 1
    log.close()
    log.emit("still fine")


def ev(ts, event, **fields):
    return {"ts": ts, "event": event, **fields}


def test_summarize_recovery():
    events = [
        ev(1.0, "generation_formed", generation=1, world_size=4),
        ev(2.0, "step_finished", generation=1, step=10),
        ev(3.0, "step_finished", generation=1, step=11),
        ev(10.0, "failure_detected", node="w2", rank=2, signal="SIGKILL", generation=1),
        ev(10.5, "failure_detected", node="w3", rank=3, kind="heartbeat", generation=1),
        ev(10.6, "step_finished", generation=1, step=12),  # a straggler of the old generation
        ev(14.0, "generation_formed", generation=2, world_size=2),
        ev(15.0, "restore_step", generation=2, to_step=10, from_step=12),
        ev(15.5, "restored", generation=2, rank=0, source="memory"),
        ev(15.6, "restored", generation=2, rank=1, source="peer"),
        ev(17.0, "step_finished", generation=2, step=11),
        ev(18.0, "step_finished", generation=2, step=12),
        ev(30.0, "failure_detected", node="w1", rank=1, kind="exit", generation=2),
    ]
    out = summarize_recovery(list(reversed(events)))  # order of input does not matter
    assert len(out) == 2
    first, second = out
    assert first["generation"] == 2 and first["failed_generation"] == 1
    assert first["mttr_s"] == pytest.approx(7.0)
    assert (first["from_step"], first["to_step"], first["lost_steps"]) == (12, 10, 2)
    assert first["world_size"] == 2 and first["sources"] == ["memory", "peer"]
    assert first["failures"] == [
        {"node": "w2", "rank": 2, "signal": "SIGKILL"},
        {"node": "w3", "rank": 3, "kind": "heartbeat"},
    ]
    # a failure that has not recovered (yet)
    assert second["generation"] is None and second["failed_generation"] == 2
    assert second["mttr_s"] is None and second["lost_steps"] is None
    assert summarize_recovery([]) == []


def test_summarize_cascading_failure():
    events = [
        ev(1.0, "failure_detected", rank=1, generation=1),
        ev(2.0, "generation_formed", generation=2, world_size=3),
        ev(3.0, "failure_detected", rank=2, generation=2),  # fails again before any step
        ev(4.0, "generation_formed", generation=3, world_size=2),
        ev(5.0, "restore_step", generation=3, to_step=7, from_step=9),
        ev(6.0, "step_finished", generation=3, step=8),
    ]
    a, b = summarize_recovery(events)
    assert a["generation"] == 2 and a["mttr_s"] is None
    assert b["generation"] == 3 and b["mttr_s"] == pytest.approx(3.0) and b["lost_steps"] == 2


def test_the_dead_rank_is_named_before_a_survivors_failed_collective():
    """Under load a survivor's report of its failed collective can reach the scheduler before the
    dead rank's exit does; the summary still names the dead rank first."""
    evs = [
        {"ts": 1.0, "event": "fault_injected", "rank": 1, "generation": 1},
        {"ts": 1.1, "event": "failure_detected", "node": "0", "rank": 0, "kind": "collective", "generation": 1,
         "next_generation": 2},
        {"ts": 1.2, "event": "failure_detected", "node": "1", "rank": 1, "kind": "exited", "signal": "SIGKILL",
         "generation": 1, "next_generation": 2},
        {"ts": 1.5, "event": "generation_formed", "generation": 2, "world_size": 2},
        {"ts": 1.6, "event": "restore_step", "generation": 2, "from_step": 100, "to_step": 100},
        {"ts": 1.7, "event": "step_finished", "generation": 2, "step": 101},
    ]
    (rec,) = summarize_recovery(evs)
    assert [f["rank"] for f in rec["failures"]] == [1, 0]
    assert rec["failure_ts"] == 1.1 and rec["mttr_s"] == pytest.approx(0.7)
