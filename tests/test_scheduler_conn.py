"""One connection to a real scheduler process (control/conn.py): requests sent together are answered in
order, each after its save, and a peer that never reads its replies is stopped, not buffered."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from trainguard.control import auth
from trainguard.control import membership as m
from trainguard.control import protocol as p
from trainguard.control.db import ClusterDB
from trainguard.testing.simworkers import SchedulerUnderTest

SECRET = b"a secret for the connection tests, 32+ chars"
HOST = "conn-test-host"  # not this machine: the scheduler kills only hung workers on its own host


@pytest.fixture
def scheduler(tmp_path):
    secret_file = tmp_path / "job.secret"
    secret_file.write_bytes(SECRET)
    secret_file.chmod(0o600)
    recovery = tmp_path / "recovery"
    recovery.mkdir()
    sched = SchedulerUnderTest(2, recovery, secret_file, log=tmp_path / "scheduler.log")
    yield sched, recovery
    sched.kill()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return auth.client_handshake(sock, SECRET, "the test's scheduler")


def register(node_id: str) -> bytes:
    return p.encode(p.Register(node_id=node_id, host=HOST, pid=0, worker_num=2))


def test_requests_sent_together_are_answered_in_order_and_each_after_its_save(scheduler):
    sched, recovery = scheduler
    sock = connect(sched.port)
    beat = p.encode(p.Heartbeat(node_id="0", incarnation=1, generation=0, step=-1))
    sock.sendall(register("0") + beat + p.encode(p.Status()) + register("1"))  # one write, four requests
    replies = [p.decode_reply(p.read_frame(sock)) for _ in range(4)]
    assert [type(r) for r in replies] == [p.Registered, p.HeartbeatAck, p.StatusReply, p.Registered], replies
    assert [n["node_id"] for n in replies[2].state["nodes"]] == ["0"]  # between the two registrations
    sched.kill()  # kill -9: what was acknowledged is in cluster.db
    sock.close()
    db = ClusterDB(recovery)
    try:
        saved = db.load()
        assert sorted(saved.nodes) == ["0", "1"]  # alive, which a new scheduler loads as unknown until it hears
        assert {n.state for n in saved.nodes.values()} == {m.NodeState.UNKNOWN}
    finally:
        db.close()


def rss_mb(pid: int) -> float:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmRSS:"):
            return int(row.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_peer_that_never_reads_its_replies_is_stopped_not_buffered(scheduler):
    """2,000,000 status requests (26 MB) from a peer that reads nothing: the scheduler answers until its
    buffer for that peer is full, then stops reading from it (the rest waits in the kernel's buffers and
    the hog's send blocks). Meanwhile another client is answered at once, and the hog's replies are there,
    in order, when it reads."""
    sched, _ = scheduler
    hog = connect(sched.port)
    before = rss_mb(sched.proc.pid)
    status = p.encode(p.Status())
    flood = status * 2_000_000
    sent = [0]

    def send() -> None:
        hog.settimeout(3)
        try:
            sent[0] = hog.send(flood)  # a partial send once the kernel's buffers are full
            while sent[0] < len(flood):
                sent[0] += hog.send(flood[sent[0]:])
        except (TimeoutError, OSError):
            pass

    sender = threading.Thread(target=send)
    sender.start()
    sender.join(300)  # the hog's send blocked for 3 s: the scheduler stopped reading it (a hang guard only)
    assert not sender.is_alive() and sent[0] < len(flood), f"the scheduler read all {sent[0]} bytes"
    other = connect(sched.port)
    t = time.monotonic()
    other.sendall(status)
    assert isinstance(p.decode_reply(p.read_frame(other)), p.StatusReply)
    assert time.monotonic() - t < 30, "a peer that reads nothing held up another client"  # loose: a hang guard
    grew = rss_mb(sched.proc.pid) - before
    assert grew < 20, f"the scheduler grew by {grew:.0f} MB buffering replies nobody reads"
    reply_size = len(p.read_frame(hog)) + p.HEADER.size  # the hog reads: its replies come, in order
    assert reply_size > 10 * len(status) and isinstance(p.decode_reply(p.read_frame(hog)), p.StatusReply)
    hog.close()
    other.close()


def test_a_handshake_still_open_when_the_job_ends_is_not_a_refusal(scheduler, tmp_path):
    """A client that has not answered the challenge when the job ends is closed by the scheduler: that is the
    job's end, not a stranger refused, and events.jsonl still ends with job_end."""
    sched, recovery = scheduler
    idle = socket.create_connection(("127.0.0.1", sched.port), timeout=10)
    assert idle.recv(auth.HELLO_SIZE, socket.MSG_WAITALL)[:3] == auth.MAGIC  # then it says nothing
    workers = [connect(sched.port) for _ in range(2)]
    for i, sock in enumerate(workers):
        sock.sendall(register(str(i)))
        assert isinstance(p.decode_reply(p.read_frame(sock)), p.Registered)
    for i, sock in enumerate(workers):
        sock.sendall(p.encode(p.Finish(node_id=str(i), incarnation=1, ok=True)))
        assert isinstance(p.decode_reply(p.read_frame(sock)), p.Ok)
    assert sched.proc.wait(timeout=10) == 0
    kinds = [json.loads(line)["event"] for line in (recovery / "events.jsonl").read_text().splitlines()]
    assert kinds[-1] == "job_end" and "connection_refused" not in kinds, kinds
    assert idle.recv(1) == b""  # closed
    for sock in [idle, *workers]:
        sock.close()
