"""A real scheduler on loopback: hostile bytes, a full cluster, a busy port, and how the job ends.

Workers are played by SchedulerClient objects in threads (no torch). Their host name is made
up, so a scheduler that times one out never SIGKILLs a process of this machine.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import pytest
from harness import free_port, wait_for

from trainguard.config import MAX_FRAME_BYTES, ClusterConfig, LaunchMode, Role
from trainguard.control import auth
from trainguard.control import protocol as p
from trainguard.control.client import Heartbeater, SchedulerClient, query_status
from trainguard.control.membership import JobState, NodeState
from trainguard.control.outcomes import FinishDecision
from trainguard.control.sched_main import start_in_thread
from trainguard.errors import ConfigError, ProtocolError, RegistrationRejected

REPO = Path(__file__).resolve().parents[1]
HOST = "wire-test-host"  # not this machine: the scheduler kills only hung workers on its own host
N = 2
WAIT_S = 5.0


# --- helpers ----------------------------------------------------------------------------------


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()  # the scheduler drops a silent peer
        return True
    except OSError:
        return False


def in_thread(tmp_path: Path, **overrides):
    fields = dict(role=Role.SCHEDULER, mode=LaunchMode.DYNAMIC, sched_host="127.0.0.1", sched_port=0,
                  worker_num=N, enable_recovery=True, recovery_path=tmp_path / "recovery",
                  heartbeat_interval=0.5, heartbeat_timeout=30.0)
    sched, thread = start_in_thread(ClusterConfig(**{**fields, **overrides}))
    return sched, thread, ("127.0.0.1", sched.port)


def scheduler_process(port: int, tmp_path: Path, *, recovery: bool) -> subprocess.Popen:
    env = {**os.environ, "TG_SCHED_HOST": "127.0.0.1", "TG_SCHED_PORT": str(port), "TG_WORKER_NUM": str(N),
           "TG_HEARTBEAT_TIMEOUT": "30", "PYTHONUNBUFFERED": "1"}
    for name in [k for k in env if k.startswith(("TG_", "MS_")) and k not in
                 ("TG_SCHED_HOST", "TG_SCHED_PORT", "TG_WORKER_NUM", "TG_HEARTBEAT_TIMEOUT")]:
        del env[name]
    if recovery:
        env.update(TG_ENABLE_RECOVERY="1", TG_RECOVERY_PATH=str(tmp_path / "recovery"))
    return subprocess.Popen([sys.executable, "-m", "trainguard", "scheduler"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def proc_sched(tmp_path):
    """Start `python -m trainguard scheduler` on a free port; always reaped at teardown."""
    started: list[subprocess.Popen] = []

    def start(*, recovery: bool = True):
        port = free_port()
        proc = scheduler_process(port, tmp_path, recovery=recovery)
        started.append(proc)
        wait_for(lambda: listening(port) or proc.poll() is not None, 120, "the scheduler to listen")  # a hang guard
        return proc, ("127.0.0.1", port)

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=WAIT_S)


def client(address) -> SchedulerClient:
    return SchedulerClient(address, connect_timeout=WAIT_S)


def register_all(address, ids) -> list[SchedulerClient]:
    clients = [client(address) for _ in ids]
    for c, node_id in zip(clients, ids):
        c.register(node_id=node_id, host=HOST, pid=0, worker_num=N)
    return clients


def form(clients) -> list[p.Formed]:
    """Every worker joins at once; the scheduler answers when all N have joined."""
    with ThreadPoolExecutor(len(clients)) as pool:
        return list(pool.map(lambda c: c.join(after=0, timeout=WAIT_S), clients))


def agree_finish(clients, generation: int) -> list[dict]:
    with ThreadPoolExecutor(len(clients)) as pool:
        return list(pool.map(lambda c: c.agree(generation, "finish", {"step": 9}, timeout=WAIT_S), clients))


def run_job(address, ids=("0", "1")) -> list[p.Formed]:
    """A whole job over the wire: register, form, agree to finish, finish OK."""
    clients = register_all(address, ids)
    formed = form(clients)
    assert {f.generation for f in formed} == {1}
    assert sorted(f.rank for f in formed) == list(range(N)) and {f.world_size for f in formed} == {N}
    assert [mb.node_id for mb in formed[0].members] == sorted(ids)
    assert agree_finish(clients, 1) == [FinishDecision(ok=True, steps=[9])] * N
    for c in clients:
        c.finish(ok=True)
        c.close()
    return formed


def run_job_with(clients) -> None:
    """Finish a job whose workers have registered."""
    form(clients)
    agree_finish(clients, 1)
    for c in clients:
        c.finish(ok=True)
        c.close()


def exchange(address, data: bytes, *, shut: bool = False) -> tuple[object | None, bytes]:
    """Send raw bytes; return the decoded first reply (or None) and whatever else came before EOF."""
    with socket.create_connection(address, timeout=WAIT_S) as sock:
        greeting = sock.recv(auth.HELLO_SIZE, socket.MSG_WAITALL)  # the handshake's hello (no secret: open)
        assert greeting[:3] == auth.MAGIC and greeting[4] == 0, greeting
        sock.sendall(data)
        if shut:
            sock.shutdown(socket.SHUT_WR)
        received = bytearray()
        try:
            while chunk := sock.recv(65536):  # EOF: the scheduler closed this connection
                received += chunk
        except ConnectionResetError:  # it closed with bytes of ours unread, which is a close too
            assert received, "reset before any reply"
    if not received:
        return None, b""
    length = p.parse_header(bytes(received[:p.HEADER.size]))
    body = bytes(received[p.HEADER.size:p.HEADER.size + length])
    return p.decode_reply(body), bytes(received[p.HEADER.size + length:])


def events(tmp_path: Path) -> list[dict]:
    path = tmp_path / "recovery" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def frame(payload: bytes, *, version: int = p.PROTOCOL_VERSION, length: int | None = None) -> bytes:
    return p.HEADER.pack(p.MAGIC, version, len(payload) if length is None else length) + payload


# --- hostile bytes ------------------------------------------------------------------------------

NOISE = random.Random(1234).randbytes(256)

BAD_FRAMES = {
    "random bytes": (NOISE, "bad frame magic"),
    "http": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad frame magic"),
    "oversized length": (frame(b"", length=MAX_FRAME_BYTES + 1), "exceeds"),
    "max length prefix": (frame(b"", length=2**32 - 1), "exceeds"),
    "wrong version": (frame(p.encode(p.Status())[p.HEADER.size:], version=p.PROTOCOL_VERSION + 1),
                      "protocol version"),
    "invalid msgpack": (frame(b"\xc1\xc1\xc1"), "not valid msgpack"),
    "wrong shape": (frame(msgpack.packb({"type": "register", "host": "h", "pid": "x", "worker_num": N})),
                    "invalid message (register.pid"),
    "unknown type": (frame(msgpack.packb({"type": "shutdown"})), "does not match any of the expected tags"),
    "a reply, not a request": (p.encode(p.Ok()), "invalid message"),
}


def test_bad_frames_get_an_error_and_a_closed_connection_and_the_scheduler_stays_up(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="trainguard.scheduler")
    sched, thread, address = in_thread(tmp_path)
    assert NOISE[:2] != p.MAGIC
    idle = socket.create_connection(address, timeout=WAIT_S)  # a silent client must not hold anyone up
    try:
        for name, (data, expected) in BAD_FRAMES.items():
            reply, rest = exchange(address, data)
            assert isinstance(reply, p.Error), name
            assert reply.code is p.ErrorCode.BAD_MESSAGE and expected in reply.message, (name, reply.message)
            assert rest == b"", name  # nothing after the error: the connection was closed
        # cut-off frames: the peer goes away mid-header or mid-body; nothing to answer
        assert exchange(address, p.MAGIC + b"\x01", shut=True) == (None, b"")
        assert exchange(address, frame(b"", length=100) + b"\x81", shut=True) == (None, b"")
        # a good request after a bad one on the same socket is never read: the connection is gone
        reply, rest = exchange(address, frame(b"\xc1") + p.encode(p.Status()))
        assert isinstance(reply, p.Error) and rest == b""

        assert thread.is_alive()
        state = query_status(address)
        assert (state["generation"], state["formed"], state["job"], state["nodes"]) == (1, False, "running", [])
        run_job(address)  # real workers still register, form a generation and finish
        thread.join(WAIT_S)
        assert not thread.is_alive(), "the scheduler should end once every worker finished"
    finally:
        idle.close()
    dropped = [r.getMessage() for r in caplog.records if "dropped connection" in r.getMessage()]
    assert len(dropped) == len(BAD_FRAMES) + 1
    kinds = [e["event"] for e in events(tmp_path)]
    assert kinds.count("registered") == N and "generation_formed" in kinds
    assert kinds[-1] == "job_end" and events(tmp_path)[-1]["state"] == "done"


def test_a_client_that_sent_garbage_is_not_a_member(tmp_path):
    """Garbage on a connection never marks anyone dead or bumps the generation."""
    sched, thread, address = in_thread(tmp_path)
    clients = register_all(address, ["0", "1"])
    form(clients)
    for data, _ in BAD_FRAMES.values():
        exchange(address, data)
    state = query_status(address)
    assert state["generation"] == 1 and state["formed"]
    assert {n["state"] for n in state["nodes"]} == {"alive"}
    assert agree_finish(clients, 1)[0].ok
    for c in clients:
        c.finish(ok=True)
    thread.join(WAIT_S)
    assert not thread.is_alive()


# --- a full cluster ------------------------------------------------------------------------------


def test_worker_beyond_worker_num_is_rejected_and_both_sides_say_why(proc_sched, tmp_path):
    proc, address = proc_sched()
    clients = register_all(address, ["0", "1"])
    extra = client(address)
    with pytest.raises(RegistrationRejected) as info:
        extra.register(node_id="2", host=HOST, pid=0, worker_num=N)
    assert info.value.code == "full" and not info.value.retry
    assert "cluster full" in str(info.value) and "TG_WORKER_NUM" in str(info.value)
    extra.close()
    rejected = [e for e in events(tmp_path) if e["event"] == "register_rejected"]
    assert len(rejected) == 1
    assert rejected[0]["node"] == "2" and rejected[0]["code"] == "full" and "cluster full" in rejected[0]["reason"]

    run_job_with(clients)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err
    assert "rejected registration of 2" in err and "cluster full" in err


def test_duplicate_live_node_id_is_rejected(tmp_path):
    sched, thread, address = in_thread(tmp_path)
    clients = register_all(address, ["0", "1"])
    dup = SchedulerClient(address, connect_timeout=0.3)  # the refusal is retryable: give up quickly
    with pytest.raises(RegistrationRejected) as info:
        dup.register(node_id="1", host=HOST, pid=0, worker_num=N)
    assert info.value.code == "duplicate" and info.value.retry and "already registered and alive" in str(info.value)
    dup.close()
    run_job_with(clients)
    thread.join(WAIT_S)
    assert not thread.is_alive()


# --- the port -------------------------------------------------------------------------------------


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_scheduler_command_on_a_busy_port_exits_2_naming_the_port(busy_port, tmp_path):
    proc = scheduler_process(busy_port, tmp_path, recovery=False)
    out, err = proc.communicate(timeout=WAIT_S * 2)
    assert proc.returncode == 2, err
    assert f"127.0.0.1:{busy_port}" in err and "in use" in err and "TG_SCHED_PORT" in err
    assert "Traceback" not in err


def test_embedded_scheduler_on_a_busy_port_raises_config_error(busy_port, tmp_path):
    cfg = ClusterConfig(role=Role.SCHEDULER, mode=LaunchMode.DYNAMIC, sched_host="127.0.0.1",
                        sched_port=busy_port, worker_num=N)
    with pytest.raises(ConfigError, match=f"127.0.0.1:{busy_port}.*in use"):
        start_in_thread(cfg)


# --- how the job ends -------------------------------------------------------------------------------


def test_scheduler_exits_0_when_every_worker_finished(proc_sched, tmp_path):
    proc, address = proc_sched()
    run_job(address, ids=("a", "b"))
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err
    assert "all 2 workers finished" in err and "job failed" not in err
    kinds = [e["event"] for e in events(tmp_path)]
    assert kinds[0] == "scheduler_started" and kinds[-1] == "job_end"
    assert kinds.count("finished") == N and "agreed_finish" in kinds


def test_scheduler_exits_3_with_the_root_cause_when_a_worker_fails(proc_sched, tmp_path):
    proc, address = proc_sched(recovery=False)
    clients = register_all(address, ["0", "1"])
    form(clients)
    cause = "RuntimeError: loss is nan at step 17"
    clients[1].finish(ok=False, detail=cause)
    for c in clients:
        c.close()
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 3, err
    failed = [line for line in err.splitlines() if line.startswith("trainguard: job failed:")]
    assert len(failed) == 1 and "worker 1 (rank 1" in failed[0] and cause in failed[0], err


def test_embedded_scheduler_ends_a_failed_job_while_workers_are_still_connected(tmp_path, caplog):
    """The survivor's request and heartbeat connections stay open: the scheduler still ends, and
    closing them at the end is not reported as one more failure."""
    caplog.set_level(logging.WARNING, logger="trainguard.scheduler")
    sched, thread, address = in_thread(tmp_path, enable_recovery=False, recovery_path=None)
    clients = register_all(address, ["0", "1"])
    form(clients)
    beat = Heartbeater(address, clients[0].identity, interval=0.05)
    beat.start()
    try:
        assert beat.connected.wait(WAIT_S)
        clients[1].finish(ok=False, detail="boom")
        thread.join(WAIT_S)
        assert not thread.is_alive(), "the scheduler must not wait for its clients to disconnect"
    finally:
        beat.stop()
        for c in clients:
            c.close()
    assert sched.cluster.job is JobState.FAILED and "worker 1" in sched.cluster.root_cause
    assert "boom" in sched.cluster.root_cause
    assert sched.cluster.nodes["0"].state is NodeState.ALIVE
    warnings = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(warnings) == 1 and "worker 1" in warnings[0], warnings


def test_concurrent_clients_each_get_their_own_reply(tmp_path):
    """Many status requests at once, interleaved with bad frames: every good one is answered."""
    sched, thread, address = in_thread(tmp_path)
    results: list[object] = []
    lock = threading.Lock()

    def good():
        state = query_status(address)
        with lock:
            results.append(state["worker_num"])

    def bad():
        reply, _ = exchange(address, NOISE)
        with lock:
            results.append(reply.code)

    threads = [threading.Thread(target=good if i % 2 else bad) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert sorted(map(str, results)) == sorted([str(N)] * 10 + [str(p.ErrorCode.BAD_MESSAGE)] * 10)
    run_job(address)
    thread.join(WAIT_S)
    assert not thread.is_alive()


# --- the client against a peer that does not speak our protocol -------------------------------------


def test_client_drops_a_connection_whose_reply_was_not_a_valid_frame():
    """After a bad reply the stream is out of step: the client must reconnect, not reuse it."""
    good = p.encode(p.StatusReply(state={"worker_num": N}))
    bad_replies = [p.HEADER.pack(p.MAGIC, p.PROTOCOL_VERSION + 1, 0), b"HTTP/1.1 400 Bad Request\r\n\r\n"]
    accepted: list[int] = []

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = listener.getsockname()

        def serve() -> None:  # connection i answers every request with bad_replies[i], then good ones
            for i in range(len(bad_replies) + 1):
                conn, _ = listener.accept()
                accepted.append(i)
                threading.Thread(target=answer, args=(conn, bad_replies[i] if i < len(bad_replies) else good),
                                 daemon=True).start()

        def answer(conn: socket.socket, reply: bytes) -> None:
            with conn:
                try:
                    conn.sendall(auth.hello(None)[0])  # an open scheduler's greeting
                    while True:
                        p.read_frame(conn)
                        conn.sendall(reply)
                except (ConnectionError, OSError):
                    return

        threading.Thread(target=serve, daemon=True).start()
        c = client(address)
        with pytest.raises(ProtocolError, match=f"protocol version {p.PROTOCOL_VERSION + 1} is not supported"):
            c.status()
        with pytest.raises(ProtocolError, match="bad frame magic"):
            c.status()
        assert c.status() == {"worker_num": N}
        c.close()
    assert accepted == [0, 1, 2]
