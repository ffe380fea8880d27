"""Every number a peer sends is bounded, so one buggy or hostile member holding the job secret can neither
plan with counts no machine has nor break what the scheduler reports (status, metrics, events.jsonl,
cluster.db). Tested against a real scheduler over real sockets: the extremes a fuzzer once got accepted are
refused with the field named; values at the edge of every range are accepted and everything the scheduler
reports still serialises; and a seeded fuzz run of about 30 s leaves no handler error and an answering
`status` after every batch."""

from __future__ import annotations

import json
import socket
import sqlite3
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
from harness import free_port

from trainguard.config import MAX_SLOTS, ClusterConfig, LaunchMode, Role
from trainguard.control import auth
from trainguard.control import protocol as p
from trainguard.control.client import SchedulerClient, query_status
from trainguard.control.msgbase import INT64_MAX, MAX_INCARNATION
from trainguard.control.outcomes import FinishDecision, RestoreDecision, Source, SourceKind
from trainguard.control.sched_main import start_in_thread
from trainguard.testing.fuzz import fuzz_scheduler

SECRET = b"bounds-test-secret-0123456789"
HOST = "bounds-test-host"  # not this machine: the scheduler never signals a pid of it
INT64_MIN = -INT64_MAX - 1


@pytest.fixture
def sched(tmp_path):
    cfg = ClusterConfig(role=Role.SCHEDULER, mode=LaunchMode.DYNAMIC, sched_host="127.0.0.1", sched_port=0,
                        worker_num=2, enable_recovery=True, recovery_path=tmp_path / "recovery",
                        heartbeat_interval=0.5, heartbeat_timeout=60.0, secret=SECRET,
                        metrics_port=free_port(), metrics_host="127.0.0.1")
    scheduler, _ = start_in_thread(cfg)
    yield scheduler, ("127.0.0.1", scheduler.port)


def members(address) -> list[SchedulerClient]:
    clients = [SchedulerClient(address, connect_timeout=5.0, secret=SECRET) for _ in range(2)]
    for i, c in enumerate(clients):
        c.register(node_id=f"m{i}", host=HOST, pid=0, worker_num=2)
    with ThreadPoolExecutor(2) as pool:
        assert [f.generation for f in pool.map(lambda c: c.join(after=0, timeout=5.0), clients)] == [1, 1]
    return clients


def send(address, *reqs: dict) -> list:
    """Raw requests on one connection that holds the job secret (an agent's); the replies, decoded."""
    sock = auth.client_handshake(socket.create_connection(address, timeout=5.0), SECRET, "the scheduler")
    replies = []
    with sock:
        for req in reqs:
            body = msgpack.packb(req, use_bin_type=True)
            sock.sendall(p.HEADER.pack(p.MAGIC, p.PROTOCOL_VERSION, len(body)) + body)
            replies.append(p.decode_reply(p.read_frame(sock)))
    return replies


def ident(client: SchedulerClient) -> dict:
    return {"node_id": client.identity.node_id, "incarnation": client.identity.incarnation}


def test_the_fuzzers_extremes_are_refused_with_the_field_named_and_status_keeps_working(sched):
    _, address = sched
    m0, _ = members(address)
    refused = {
        "register.worker_num": {"type": "register", "node_id": "x", "host": "h", "pid": 0,
                                "worker_num": 9223372036854775808},
        "agent_sync.agent": {"type": "agent_sync", "agent": 9223372036854775807, "host": "h", "slots": 1},
        "agent_sync.slots": {"type": "agent_sync", "agent": 0, "host": "h", "slots": 18446744073709551615},
        "agent_place.agent": {"type": "agent_place", "agent": -1, "node_id": "m0"},
        "heartbeat.step": {"type": "heartbeat", **ident(m0), "generation": 1, "step": 2**64 - 1},
        "heartbeat.incarnation": {"type": "heartbeat", "node_id": "m0", "incarnation": MAX_INCARNATION + 1,
                                  "generation": 1, "step": 0},
        "process_exited.exit_code": {"type": "process_exited", "node_id": "m0", "pid": 1, "exit_code": -2**63},
        "store.amount": {"type": "store", **ident(m0), "generation": 1, "op": "add", "keys": ["k"],
                         "amount": 2**63},
        "agree.payload": {"type": "agree", **ident(m0), "generation": 1, "purpose": "restore", "timeout": 1.0,
                          "payload": {"step": -1, "disk": []}},
        "join.timeout": {"type": "join", **ident(m0), "after": 1, "timeout": float("inf")},
    }
    for field, req in refused.items():
        [reply] = send(address, req)
        assert isinstance(reply, p.Error) and reply.code is p.ErrorCode.BAD_MESSAGE, (field, reply)
        assert f"({field}" in reply.message, (field, reply.message)
        assert query_status(address, secret=SECRET)["worker_num"] == 2
    # in range for any job, outside this one's: node ranks and shards of a job of 2 are 0 and 1
    for field, req in {"agent_sync.agent": {"type": "agent_sync", "agent": 2, "host": "h", "slots": 4},
                       "agree.payload.shard": {"type": "agree", **ident(m0), "generation": 1, "purpose": "restore",
                                               "timeout": 1.0, "payload": {"step": 3, "disk": [], "shard": 7}},
                       "agree.payload.memory": {"type": "agree", **ident(m0), "generation": 1, "purpose": "restore",
                                                "timeout": 1.0,
                                                "payload": {"step": 3, "disk": [], "shard": 1, "memory": {"9": [2]}}},
                       }.items():
        [reply] = send(address, req)
        assert isinstance(reply, p.Error) and f"({field}" in reply.message and "outside 0..1" in reply.message
    # a join after a generation that never formed was a busy loop that froze the scheduler (found by the fuzzer)
    [reply] = send(address, {"type": "join", **ident(m0), "after": INT64_MAX, "timeout": 1.0})
    assert isinstance(reply, p.Error) and "the newest generation this job formed is 1" in reply.message
    state = query_status(address, secret=SECRET)
    assert [n["node_id"] for n in state["nodes"]] == ["m0", "m1"] and state["generation"] == 1


def test_the_edge_of_every_range_is_accepted_and_all_the_scheduler_reports_serialises(sched, tmp_path):
    scheduler, address = sched
    m0, m1 = members(address)
    a, b = ident(m0), ident(m1)
    ids = [f"n{i}" for i in range(MAX_SLOTS)]
    accepted = send(
        address,
        {"type": "store", **a, "generation": 1, "op": "add", "keys": ["k"], "amount": INT64_MAX},
        {"type": "store", **a, "generation": 1, "op": "add", "keys": ["j"], "amount": INT64_MIN},
        {"type": "agent_sync", "agent": 1, "host": "h" * 255, "slots": MAX_SLOTS, "running": ids,
         "handled": [INT64_MAX] * MAX_SLOTS},
        {"type": "agent_place", "agent": 1, "node_id": "z" * 64, "in_place_ok": True},
        {"type": "host_beat", "host": "h", "beats": [{"node_id": "m0", "incarnation": MAX_INCARNATION,
                                                      "step": INT64_MAX, "age_ms": 3_600_000}] * 4096},
        {"type": "process_exited", "node_id": "z" * 64, "pid": 1 << 22, "exit_code": -255, "signal": 128,
         "detail": "\x1b[31m\n" * 2000},
    )
    assert not any(isinstance(r, p.Error) and r.code is p.ErrorCode.BAD_MESSAGE for r in accepted), accepted
    with ThreadPoolExecutor(2) as pool:  # every agreement, at the edges of its report
        for purpose, report in [("restore", {"step": INT64_MAX, "disk": [INT64_MAX] * 4096, "node": "m"}),
                                ("error", {"signature": "\x00" * 1024, "step": INT64_MIN}),
                                ("finish", {"step": INT64_MAX})]:
            decisions = list(pool.map(lambda c: c.agree(1, purpose, report, timeout=5.0), (m0, m1)))
            assert decisions[0] == decisions[1] and decisions[0].purpose == purpose
            if purpose == "restore":  # both live at int64's top: both keep their state
                assert decisions[0] == RestoreDecision(step=INT64_MAX, from_step=INT64_MAX,
                                                       sources=[Source(kind=SourceKind.SELF)] * 2)
    assert decisions[0] == FinishDecision(ok=True, steps=[INT64_MAX])
    beats = send(address,  # the connection a heartbeat came on closes: both members fail (as a member would)
                 {"type": "heartbeat", **a, "generation": INT64_MAX, "step": INT64_MAX},
                 {"type": "heartbeat", **a, "generation": 0, "step": 0},
                 {"type": "heartbeat", **b, "generation": 1, "step": INT64_MAX})
    assert all(isinstance(r, p.HeartbeatAck) for r in beats), beats
    send(address, {"type": "report_failure", **b, "generation": 1, "kind": "exited", "detail": "\x7f" * 8192})
    SchedulerClient(address, connect_timeout=5.0, secret=SECRET).register(node_id="y" * 64, host="h" * 255,
                                                                          pid=1 << 22, worker_num=2)

    state = query_status(address, secret=SECRET)
    json.dumps(state, allow_nan=False)
    assert state["step"] == INT64_MAX and 0 <= state["steps_done"] <= INT64_MAX
    assert "y" * 64 in [n["node_id"] for n in state["nodes"]] and len(state["nodes"]) == 2  # took a dead one's place
    scrape = urllib.request.urlopen(f"http://127.0.0.1:{scheduler.cfg.metrics_port}/metrics", timeout=5).read()
    assert b"trainguard_" in scrape
    for line in (tmp_path / "recovery" / "events.jsonl").read_text().splitlines():
        _all_int64(json.loads(line))
    with sqlite3.connect(tmp_path / "recovery" / "cluster.db") as db:  # the scheduler keeps it open: read it
        rows = db.execute("SELECT node_id, rank, host, pid, incarnation FROM nodes").fetchall()
    assert {r[0] for r in rows} >= {"m0", "y" * 64} and all(isinstance(r[3], int) for r in rows)


def _all_int64(obj) -> None:
    if isinstance(obj, int) and not isinstance(obj, bool):
        assert INT64_MIN <= obj <= INT64_MAX, obj
    elif isinstance(obj, dict):
        for v in obj.values():
            _all_int64(v)
    elif isinstance(obj, list):
        for v in obj:
            _all_int64(v)


def test_ten_seconds_of_fuzzing_leave_no_handler_error_and_status_answers_after_every_batch(tmp_path):
    """A real scheduler process; the fuzzer holds the job secret (and plays strangers without it). Ten
    seconds here (two busy processes); `python bench/fuzz_scheduler.py --frames 1000000` runs a long campaign."""
    out = fuzz_scheduler(tmp_path, seed=20261126, frames=10**9, seconds=10, status_limit_s=10.0)
    tally = out.tally
    assert not out.crashed and out.hangs == 0, out
    assert out.handler_errors == [], out.handler_errors[:5]
    assert out.strangers == []  # no frame of a client without the secret reached a handler
    assert tally.answered == tally.frames > 1000 and tally.unauthenticated > 0
    assert {"member", "extreme", "random", "mutated"} <= set(tally.kinds)
    assert out.peak_rss_mb < 400, out.peak_rss_mb
