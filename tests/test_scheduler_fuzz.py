"""A scheduler a stranger (or a member gone bad) cannot break, tested against a real one: random and mutated
frames (hypothesis, a bounded number of examples) leave it alive, a well-formed request is still answered
within 1 s, a handler's error is an answer, and the monitor still declares a silent member dead on time.
Frames of empty maps cost little and block nothing; a flood of connections is turned away; and the pid in
a message never makes it kill a process that is not its client."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_wire import (
    HOST,
    WAIT_S,
    client,
    exchange,
    form,
    frame,
    in_thread,
    register_all,
)

from trainguard.config import this_host
from trainguard.control import auth
from trainguard.control import protocol as p
from trainguard.control.client import query_status
from trainguard.control.scheduler import MAX_CONNECTIONS_BASE, PENDING_PER_PEER_BASE

TYPES = ["register", "reattach", "heartbeat", "join", "report_failure", "agree", "finish", "process_exited",
         "status", "store", "agent_sync", "agent_place", "bogus"]
FIELDS = ["node_id", "incarnation", "generation", "host", "pid", "worker_num", "step", "purpose", "payload",
          "timeout", "op", "key", "keys", "value", "kind", "detail", "exit_code", "after", "agent", "running"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
                    st.floats(allow_nan=True), st.text(max_size=40).filter(lambda s: s != "vm"),
                    st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8),
                                                                                            inner, max_size=5),
                      max_leaves=20)
requests = st.fixed_dictionaries({"type": st.sampled_from(TYPES)}, optional={
    f: values for f in FIELDS}).map(lambda d: {**d, "timeout": 0.05} if "timeout" in d else d)


def mutated(payload: bytes, data) -> bytes:
    raw = bytearray(payload)
    for _ in range(data.draw(st.integers(0, 4))):
        if raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    return bytes(raw)


def send(address, data: bytes) -> None:
    """One frame on a fresh connection; read the answer (or the close) for at most a short while."""
    with socket.create_connection(address, timeout=WAIT_S) as sock:
        sock.recv(auth.HELLO_SIZE, socket.MSG_WAITALL)
        sock.sendall(data)
        sock.settimeout(0.3)  # a join or agree waits for others: do not wait for its answer
        try:
            sock.recv(65536)
        except (TimeoutError, ConnectionError):
            pass


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    sched, thread, address = in_thread(tmp_path_factory.mktemp("fuzz"), heartbeat_interval=0.1,
                                       heartbeat_timeout=1.0)
    yield sched, thread, address


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(req=requests, data=st.data())
def test_random_and_mutated_frames_never_break_the_scheduler(fuzzed, req, data):
    _, thread, address = fuzzed
    payload = msgpack.packb(req, use_bin_type=True)
    send(address, frame(mutated(payload, data) if data.draw(st.booleans()) else payload))
    assert thread.is_alive()


def test_after_the_fuzzing_it_answers_fast_and_still_detects_a_silent_member(fuzzed):
    _, thread, address = fuzzed
    t0 = time.monotonic()
    state = query_status(address)
    assert time.monotonic() - t0 < 1.0 and thread.is_alive()
    member = client(address)
    reg = member.register(node_id="1", host=HOST, pid=0, worker_num=2)  # a fuzzed "1" died long ago
    t1 = time.monotonic()
    while time.monotonic() - t1 < 5.0:  # heartbeat timeout 1 s: declared dead within a few monitor periods
        nodes = {n["node_id"]: n for n in query_status(address)["nodes"]}
        if nodes.get(reg.node_id, {}).get("state") not in ("alive", "unknown"):
            break
        time.sleep(0.1)
    took = time.monotonic() - t1
    assert nodes[reg.node_id]["state"] not in ("alive", "unknown") and took < 3.0, (took, state)
    member.close()


def test_a_frame_of_empty_maps_is_refused_before_it_costs_anything(tmp_path):
    _, thread, address = in_thread(tmp_path)
    for n in (40 << 20, (4 << 20) - 64):  # 40 MiB: refused at the header; 4 MiB: at the 100,000th map
        body = msgpack.packb({"type": "status", "x": [{}] * (n - 32)})[:n]
        data = frame(body) if n <= p.MAX_REQUEST_BYTES else frame(body[:4096], length=n)  # the rest is never read
        t0 = time.monotonic()
        reply, rest = exchange(address, data)
        assert isinstance(reply, p.Error) and reply.code is p.ErrorCode.BAD_MESSAGE
        assert ("exceeds" if n > p.MAX_REQUEST_BYTES else "too many maps") in reply.message
        # the message shows where it was refused (the header, the 100,000th map); the time is a hang guard only
        # (2.46 s seen under load, sending 4 MiB over loopback included)
        assert time.monotonic() - t0 < 30.0
        assert query_status(address)["worker_num"] == 2 and thread.is_alive()


def raw_requests(address, reqs: list[dict]) -> list:
    """Send each request on one raw connection and return the decoded replies."""
    replies = []
    with socket.create_connection(address, timeout=WAIT_S) as sock:
        sock.recv(auth.HELLO_SIZE, socket.MSG_WAITALL)
        for req in reqs:
            sock.sendall(frame(msgpack.packb(req, use_bin_type=True)))
            length = p.parse_header(p.recv_exact(sock, p.HEADER.size))
            replies.append(p.decode_reply(p.recv_exact(sock, length)))
    return replies


def test_a_handler_that_fails_on_a_hostile_value_answers_with_an_error(tmp_path):
    _, thread, address = in_thread(tmp_path)
    members = register_all(address, ["0", "1"])
    form(members)
    me = {"node_id": "0", "incarnation": members[0].identity.incarnation, "generation": 1, "type": "store"}
    replies = raw_requests(address, [{**me, "op": "set", "keys": ["k"], "value": b"not a number"},
                                     {**me, "op": "add", "keys": ["k"], "amount": 1},
                                     {**me, "op": "set", "keys": ["n"], "value": str(2**63 - 2).encode()},
                                     {**me, "op": "add", "keys": ["n"], "amount": 2},
                                     {**me, "op": "add", "keys": ["n"], "amount": 1},
                                     {**me, "op": "add", "keys": ["n"], "amount": 2**64 - 1}])
    assert [type(r).__name__ for r in replies] == ["StoreReply", "Error", "StoreReply", "Error", "StoreReply",
                                                   "Error"]
    assert "is not a decimal integer" in replies[1].message  # answered, the connection still open
    assert "leaves the int64 range" in replies[3].message and replies[4].number == 2**63 - 1  # left unchanged
    assert "amount: Input should be less than or equal to 9223372036854775807" in replies[5].message
    assert query_status(address)["worker_num"] == 2 and thread.is_alive()


def test_the_store_is_for_the_members_of_its_generation_only(tmp_path):
    """A client that holds the secret but is not a member (no identity, an unknown node, a stale incarnation)
    can neither read nor write the rendezvous keys that gloo's addresses travel in."""
    _, thread, address = in_thread(tmp_path)
    members = register_all(address, ["0", "1"])
    form(members)
    key = ["trainguard/g1/rank_0"]
    members[0].store(p.StoreOp(generation=1, op="set", keys=key, value=b"10.0.0.1:1234"))
    strangers = [{}, {"node_id": "7", "incarnation": 1}, {"node_id": "1", "incarnation": 99}]
    for who in strangers:
        for op in ({"op": "get", "keys": key, "timeout": 0.2}, {"op": "set", "keys": key, "value": b"attacker:1"}):
            (reply,) = raw_requests(address, [{"type": "store", "generation": 1, **who, **op}])
            assert isinstance(reply, p.Error) and reply.code is p.ErrorCode.FENCED, (who, op, reply)
            assert "is for its members" in reply.message
    assert members[1].store(p.StoreOp(generation=1, op="get", keys=key, timeout=1.0)).value == b"10.0.0.1:1234"


def test_a_flood_of_connections_is_turned_away_and_members_still_get_in(tmp_path):
    _, thread, address = in_thread(tmp_path)
    limit = MAX_CONNECTIONS_BASE + 4 * 2
    flood = []
    try:
        for _ in range(limit + 20):
            flood.append(socket.create_connection(address, timeout=WAIT_S))
        time.sleep(0.5)
        refused = 0
        for s in flood:
            s.settimeout(0.5)
            try:
                refused += s.recv(auth.HELLO_SIZE) == b""
            except (TimeoutError, ConnectionError):
                pass
        assert refused >= 20
    finally:
        for s in flood:
            s.close()
    time.sleep(0.3)
    assert query_status(address)["worker_num"] == 2 and thread.is_alive()


def test_one_address_flooding_the_handshake_cannot_take_the_members_places(tmp_path):
    """A stranger on another address (127.0.0.2) opens connections and never answers the challenge: beyond
    its share (PENDING_PER_PEER_BASE + 1 per worker) they are closed at once, and while its flood is held
    open a member still connects and is served."""
    secret = b"the secret of the flood test, long enough"
    sched, thread, address = in_thread(tmp_path, secret=secret)
    share = PENDING_PER_PEER_BASE + 2
    assert share < sched.max_connections - 2 * 2
    flood = []
    try:
        for _ in range(share + 20):
            flood.append(socket.create_connection(address, timeout=WAIT_S, source_address=("127.0.0.2", 0)))
        time.sleep(0.5)
        closed = 0
        for s in flood:
            s.settimeout(0.5)
            try:
                closed += s.recv(auth.HELLO_SIZE, socket.MSG_WAITALL) == b""  # no challenge: closed at once
            except (TimeoutError, ConnectionError):
                pass
        assert closed == 20, closed
        assert query_status(address, timeout=2, secret=secret)["worker_num"] == 2  # the flood still held
    finally:
        for s in flood:
            s.close()
    assert thread.is_alive()


def test_a_large_frame_that_stalls_is_dropped_and_frees_what_it_held(tmp_path, monkeypatch):
    """A header announcing 100 kB, then 10 bytes, then nothing: dropped once FRAME_READ_TIMEOUT_S passes (frames
    up to TIMED_FRAME_BYTES are read without a timer: a stalled one holds at most that much)."""
    monkeypatch.setattr(p, "FRAME_READ_TIMEOUT_S", 0.5)
    _, thread, address = in_thread(tmp_path)
    assert p.TIMED_FRAME_BYTES < 100_000 <= p.MAX_REQUEST_BYTES
    with socket.create_connection(address, timeout=WAIT_S) as s:
        assert len(s.recv(auth.HELLO_SIZE, socket.MSG_WAITALL)) == auth.HELLO_SIZE  # open: no challenge to answer
        started = time.monotonic()
        s.sendall(p.HEADER.pack(p.MAGIC, p.PROTOCOL_VERSION, 100_000) + b"x" * 10)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert 0.4 < time.monotonic() - started < 5
    reply = p.decode_reply(got[p.HEADER.size:])
    assert isinstance(reply, p.Error) and "100000-byte frame did not arrive within 0.5 s" in reply.message
    assert thread.is_alive()


def wait_dead(address, node_id: str, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        nodes = {n["node_id"]: n["state"] for n in query_status(address)["nodes"]}
        if nodes.get(node_id) not in ("alive", "unknown"):
            return
        time.sleep(0.1)
    raise AssertionError(f"node {node_id} was not declared dead")


def test_the_monitor_kills_only_a_process_that_holds_a_connection_to_it(tmp_path, caplog):
    """A register naming another process's pid (here a sleeping bystander) and then silence: the monitor
    declares the member dead but kills nothing. A silent process that is connected to the scheduler (a hung
    worker) is killed."""
    caplog.set_level(logging.WARNING)
    _, thread, address = in_thread(tmp_path, heartbeat_interval=0.1, heartbeat_timeout=1.0)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    hung = subprocess.Popen([sys.executable, "-c", "import socket, sys, time; s = socket.create_connection(("
                             f"'127.0.0.1', {address[1]})); print('connected', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert hung.stdout.readline() == "connected\n"  # the hung one holds its connection
        liar, member = client(address), client(address)
        liar.register(node_id="0", host=this_host(), pid=bystander.pid, worker_num=2)
        member.register(node_id="1", host=this_host(), pid=hung.pid, worker_num=2)
        wait_dead(address, "0")
        wait_dead(address, "1")
        assert hung.wait(timeout=5) == -signal.SIGKILL
        time.sleep(0.3)
        assert bystander.poll() is None, "the scheduler killed a process that is not its client"
        assert any(f"not killing pid {bystander.pid}" in r.getMessage() for r in caplog.records)
        liar.close()
        member.close()
    finally:
        for proc in (bystander, hung):
            proc.kill()
            proc.wait()
