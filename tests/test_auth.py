"""The job secret (control/auth.py): every connection to the scheduler proves it holds it, both ways.

Real schedulers, real sockets: a stranger without the secret gets nothing (no status, no register,
no store, no exit report), a client with a wrong secret or none is refused with a message naming
the fix, a client with the secret refuses a scheduler that does not ask for one, and a job run by
`trainguard run` (which makes a secret) finishes bit-identical while a stranger knocks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import msgpack
import pytest
from harness import assert_identical, env, finals, job_args, wait_for

from trainguard.config import ClusterConfig, LaunchMode, Role, read_secret
from trainguard.control import auth
from trainguard.control import protocol as p
from trainguard.control.client import Connection, query_status
from trainguard.control.sched_main import start_in_thread
from trainguard.errors import AuthenticationFailed, ConfigError, ProtocolError

pytestmark = pytest.mark.timeout(180)

SECRET = b"a secret of this test, 32+ chars long"


# --- pure parts ---------------------------------------------------------------------------------------


def test_the_answer_proves_the_secret_both_ways():
    greeting, nonce_s = auth.hello(SECRET)
    assert greeting[:3] == auth.MAGIC and greeting[4] == 1 and len(greeting) == auth.HELLO_SIZE
    nonce_c = os.urandom(auth.NONCE)
    good = nonce_c + auth.proof(SECRET, b"client", nonce_s, nonce_c)
    verdict = auth.check_answer(SECRET, nonce_s, good)
    assert verdict[0] == 1 and verdict[1:] == auth.proof(SECRET, b"server", nonce_s, nonce_c)
    wrong = nonce_c + auth.proof(b"another secret, just as long....", b"client", nonce_s, nonce_c)
    assert auth.check_answer(SECRET, nonce_s, wrong) == b"\x00" + bytes(32)
    replayed = auth.hello(SECRET)[1]  # a recorded answer does not fit a fresh challenge
    assert auth.check_answer(SECRET, replayed, good)[0] == 0


def test_a_peers_text_cannot_forge_a_log_line():
    from trainguard.control.msgbase import for_log

    forged = "boom\n2026-11-24 10:00:00 trainguard.scheduler INFO: all is well\x1b[2K\r"
    assert for_log(forged) == "boom\n  | 2026-11-24 10:00:00 trainguard.scheduler INFO: all is well\\x1b[2K\\x0d"
    assert for_log("Traceback:\n\tline 3") == "Traceback:\n  | \tline 3"  # a traceback stays readable


def test_where_a_scheduler_without_a_secret_may_listen():
    assert auth.listen_policy("127.0.0.1", None, False) and auth.listen_policy("localhost", None, False)
    assert auth.listen_policy("0.0.0.0", SECRET, False) is False  # authenticated: anywhere
    assert auth.listen_policy("0.0.0.0", None, True)  # TG_INSECURE=1: allowed, with a warning
    with pytest.raises(ConfigError, match="without authentication.*TG_JOB_SECRET_FILE.*TG_INSECURE=1"):
        auth.listen_policy("0.0.0.0", None, False)


def test_the_secret_is_read_from_the_env_or_a_file_and_checked(tmp_path):
    assert read_secret({}) is None
    assert read_secret({"TG_JOB_SECRET": " " + SECRET.decode() + "\n"}) == SECRET
    path = tmp_path / "job.secret"
    path.write_text(SECRET.decode() + "\n")
    assert read_secret({"TG_JOB_SECRET_FILE": str(path)}) == SECRET
    with pytest.raises(ConfigError, match="fewer than 16"):
        read_secret({"TG_JOB_SECRET": "short"})
    with pytest.raises(ConfigError, match="set only one"):
        read_secret({"TG_JOB_SECRET": SECRET.decode(), "TG_JOB_SECRET_FILE": str(path)})
    with pytest.raises(ConfigError, match="cannot read"):
        read_secret({"TG_JOB_SECRET_FILE": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="not a regular file"):
        read_secret({"TG_JOB_SECRET_FILE": str(tmp_path)})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        read_secret({"TG_JOB_SECRET_FILE": str(tmp_path / "empty")})
    os.mkfifo(tmp_path / "fifo")  # never opened: a FIFO would block the read
    with pytest.raises(ConfigError, match="not a regular file"):
        read_secret({"TG_JOB_SECRET_FILE": str(tmp_path / "fifo")})


# --- a real scheduler ---------------------------------------------------------------------------------


def scheduler(secret: bytes | None) -> tuple[str, int]:
    """A real scheduler in a daemon thread of this process; its address."""
    cfg = ClusterConfig(role=Role.SCHEDULER, mode=LaunchMode.DYNAMIC, sched_host="127.0.0.1", sched_port=0,
                        worker_num=2, secret=secret)
    sched, _ = start_in_thread(cfg)
    return ("127.0.0.1", sched.port)


def stranger(address, frame: bytes) -> bytes:
    """A raw socket that skips the handshake: it sends a frame (padded, so that the scheduler reads a
    whole answer's worth at once) and returns all it gets before EOF."""
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(frame + bytes(auth.ANSWER_SIZE))
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
    return got


ATTACKS = [
    p.Register(node_id="0", host=socket.gethostname(), pid=1, worker_num=2),  # then silence: "kill pid 1"
    p.Status(),
    p.ProcessExited(node_id="0", pid=1, exit_code=1, detail="forged"),
    p.ReportFailure(node_id="0", incarnation=1, generation=1, kind=p.FailureKind.COLLECTIVE, detail="forged"),
    p.Join(node_id="0", incarnation=1, after=0, timeout=1.0),
    p.StoreOp(generation=1, op="set", keys=["trainguard/g1/x"], value=b"attacker:1"),
    p.AgentSync(agent=0, host="h", slots=1, running=["0"], handled=[]),
    p.AgentPlace(agent=0, node_id="0"),
]


def test_a_stranger_without_the_secret_gets_no_answer(monkeypatch):
    monkeypatch.setattr(auth, "TIMEOUT_S", 0.5)
    address = scheduler(SECRET)
    with socket.create_connection(address, timeout=10) as sock:  # a short frame: dropped at the timeout
        sock.sendall(p.encode(p.Status()))
        assert len(sock.recv(auth.HELLO_SIZE, socket.MSG_WAITALL)) == auth.HELLO_SIZE and sock.recv(100) == b""
    for msg in ATTACKS:
        got = stranger(address, p.encode(msg))
        assert got[:auth.HELLO_SIZE][:3] == auth.MAGIC  # the challenge, then the verdict "no", then EOF
        assert got[auth.HELLO_SIZE:] == b"\x00" + bytes(32), (msg.type, got)
    state = query_status(address, secret=SECRET)  # nothing of it reached the scheduler's state
    assert state["nodes"] == [] and state["job"] == "running", state


def test_wrong_or_missing_secret_is_refused_with_the_fix_and_a_downgrade_too():
    address, open_address = scheduler(SECRET), scheduler(None)
    with pytest.raises(AuthenticationFailed, match="refused this process's job secret.*TG_JOB_SECRET_FILE"):
        Connection(address, 5, secret=b"not the secret but long enough")
    with pytest.raises(AuthenticationFailed, match="requires the job secret and this process has none"):
        query_status(address)
    with pytest.raises(AuthenticationFailed, match="asks for no job secret but this process has one"):
        Connection(open_address, 5, secret=SECRET)  # a stranger posing as the scheduler is not trusted
    assert query_status(address, secret=SECRET)["worker_num"] == 2
    assert query_status(open_address)["worker_num"] == 2  # no secret on either side: loopback only


def test_a_worker_holds_a_secret_of_its_own_and_cannot_speak_as_an_agent():
    """`trainguard run` gives its workers auth.worker_secret(job secret): it admits a worker's requests, but the
    agent's (placement, host beats, exit reports) only come from a holder of the job secret itself."""
    address = scheduler(SECRET)
    worker = auth.worker_secret(SECRET)
    assert worker != SECRET and len(worker) == 64 and SECRET not in worker
    as_worker, as_agent = Connection(address, 5, secret=worker), Connection(address, 5, secret=SECRET)
    try:
        assert isinstance(as_worker.request(p.Status()), p.StatusReply)  # a worker's request: served
        for msg in (p.AgentSync(agent=0, host="h", slots=1, running=["0"], handled=[]),
                    p.AgentPlace(agent=0, node_id="0"), p.HostBeat(host="h", beats=[]),
                    p.ProcessExited(node_id="0", pid=1, exit_code=1, detail="forged")):
            reply = as_worker.request(msg)
            assert isinstance(reply, p.Error) and "only an agent may send it" in reply.message, (msg.type, reply)
            assert "only an agent" not in getattr(as_agent.request(msg), "message", ""), msg.type  # the agent: served
    finally:
        as_worker.close()
        as_agent.close()


def test_a_silent_client_is_dropped_after_the_handshake_timeout(monkeypatch):
    monkeypatch.setattr(auth, "TIMEOUT_S", 0.5)
    address = scheduler(SECRET)
    with socket.create_connection(address, timeout=10) as sock:
        assert len(sock.recv(auth.HELLO_SIZE, socket.MSG_WAITALL)) == auth.HELLO_SIZE
        started = time.monotonic()
        assert sock.recv(100) == b""  # closed without an answer from us
        assert time.monotonic() - started < 5


def test_a_scheduler_without_a_secret_refuses_a_routable_address():
    from trainguard.launch.cli import pick_free_port

    plain = {k: v for k, v in env().items() if not k.startswith("TG_JOB_SECRET") and k != "TG_INSECURE"}
    cmd = [sys.executable, "-m", "trainguard", "scheduler", "--host", "0.0.0.0", "--port",
           str(pick_free_port("0.0.0.0")), "--workers", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=plain)
    assert proc.returncode == 2 and "without authentication" in proc.stderr and "TG_INSECURE=1" in proc.stderr


# --- a real job -------------------------------------------------------------------------------------


def test_a_job_finishes_bit_identical_while_a_stranger_knocks(tmp_path, baseline_runs):
    """`trainguard run` makes a secret; a stranger on the scheduler's port, trying every message, changes nothing."""
    from trainguard.launch.cli import pick_free_port

    port = pick_free_port("127.0.0.1")
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", "2", "--sched-port", str(port), "--hot-spares", "0",
           "--recovery-path", str(tmp_path / "recovery"), *job_args(tmp_path, extra=("--step-sleep", "0.05"))]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    refused = []
    stop = threading.Event()

    def knock() -> None:
        while not stop.is_set():
            for msg in ATTACKS:
                try:
                    got = stranger(("127.0.0.1", port), p.encode(msg))
                except OSError:
                    continue
                refused.append(got[auth.HELLO_SIZE:auth.HELLO_SIZE + 1])  # the verdict (none: it was closing)

    try:
        wait_for(lambda: (tmp_path / "recovery" / "job.secret").exists(), 60, "the job's secret file")
        assert oct((tmp_path / "recovery" / "job.secret").stat().st_mode & 0o777) == "0o600"
        thread = threading.Thread(target=knock, daemon=True)
        thread.start()
        out, err = proc.communicate(timeout=150)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err[-3000:]
    assert b"\x00" in refused and b"\x01" not in refused  # refused while it ran, never let in
    assert_identical(finals(tmp_path, 2), baseline_runs(2), "final state")


def test_values_that_would_break_the_scheduler_are_refused_as_bad_messages():
    """A pid beyond pid_max crashed the heartbeat monitor (os.kill) and cluster.db (sqlite) before; a host
    with a newline forged log lines. Both are now refused by the message's schema, before any handler."""
    for bad in ({"pid": 1 << 40}, {"pid": 1 << 63}, {"host": "vm\n[scheduler] forged line"}):
        fields = {"type": "register", "node_id": "0", "host": "vm", "pid": 1, "worker_num": 2, **bad}
        with pytest.raises(ProtocolError):
            p.decode_request(msgpack.packb(fields))
    p.decode_request(msgpack.packb({"type": "register", "node_id": "0", "host": "vm", "pid": 1, "worker_num": 2}))
