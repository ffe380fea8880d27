"""Talking to the scheduler from a worker or an agent: blocking sockets, reconnects with backoff.

A worker holds two connections: one for requests (register, join, agree, store) and one for
heartbeats, whose loss tells the scheduler the process died. If the scheduler dies, both
reconnect with backoff; a restarted scheduler recognises the worker by node id and
incarnation, so training never waits on it unless membership changes.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass

from ..errors import (
    ClusterFailed,
    DesyncDetected,
    NotExact,
    FencedError,
    ProtocolError,
    RegistrationRejected,
    RendezvousTimeout,
    SchedulerUnavailable,
    TrainguardError,
)
from . import auth, tls
from . import protocol as p
from .outcomes import Decided
from .reports import Report

log = logging.getLogger("trainguard.client")

Address = tuple[str, int]
BACKOFF_START_S, BACKOFF_MAX_S = 0.05, 1.0


FROM_ENV = "env"  # a Connection's TLS context: this process's settings (TG_ENABLE_SSL, TG_SSL_CONFIG)


class Connection:
    """One socket, one request at a time. TLS as this process's environment says (control/tls.py), unless
    a context (or None: no TLS) is given."""

    def __init__(self, address: Address, timeout: float, secret: bytes | None = None,
                 tls_context: ssl.SSLContext | None | str = FROM_ENV):
        self.address = address
        ctx = tls.client_context_from() if tls_context == FROM_ENV else tls_context
        try:
            self.sock = socket.create_connection(address, timeout=timeout)
        except OSError as exc:
            raise SchedulerUnavailable(f"cannot reach the scheduler at {address[0]}:{address[1]}: {exc}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:  # TLS if asked for, and the job-secret handshake, under the connect timeout
            self.sock = auth.client_handshake(self.sock, secret, f"the scheduler at {address[0]}:{address[1]}", ctx)
        except TrainguardError:
            self.close()
            raise
        self.sock.settimeout(None)

    def request(self, msg, timeout: float | None = None):
        try:
            self.sock.settimeout(timeout)
            self.sock.sendall(p.encode(msg))
            reply = p.decode_reply(p.read_frame(self.sock))
        except (OSError, ConnectionError) as exc:
            self.close()
            raise SchedulerUnavailable(f"lost the scheduler at {self.address[0]}:{self.address[1]}: {exc}") from None
        except ProtocolError:  # the stream is out of step: this socket cannot be used again
            self.close()
            raise
        return reply

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError as exc:
            log.debug("closing scheduler socket: %s", exc)


class LocalConnection(Connection):
    """To this host's agent, which relays heartbeats (launch/relay.py), over its Unix socket. No job-secret
    handshake: the socket is in a directory only this user may enter, and the agent serves its own workers
    only (it checks the peer's pid)."""

    def __init__(self, path: str, timeout: float):
        self.address = (path, 0)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(timeout)
            self.sock.connect(path)
        except OSError as exc:
            self.close()
            raise SchedulerUnavailable(f"cannot reach this host's agent at {path} (TG_BEAT_SOCKET): {exc}") from None
        self.sock.settimeout(None)


def connect(address: Address, deadline: float, what: str = "the scheduler", secret: bytes | None = None) -> Connection:
    """Connect, retrying with backoff until the deadline (the scheduler may start last)."""
    delay = BACKOFF_START_S
    while True:
        try:
            return Connection(address, timeout=max(0.5, min(5.0, deadline - time.monotonic())), secret=secret)
        except SchedulerUnavailable as exc:
            if time.monotonic() + delay > deadline:
                raise SchedulerUnavailable(
                    f"{exc}; gave up waiting for {what}. Is it running, and do TG_SCHED_HOST/TG_SCHED_PORT "
                    "point at it? (TG_CONNECT_TIMEOUT sets how long to wait)") from None
            time.sleep(delay)
            delay = min(BACKOFF_MAX_S, delay * 2)


def raise_for(reply, what: str):
    if isinstance(reply, p.Error):
        if reply.code is p.ErrorCode.FENCED:
            raise FencedError(f"{what}: {reply.message}")
        if reply.code is p.ErrorCode.TIMEOUT:
            raise RendezvousTimeout(f"{what}: {reply.message}")
        if reply.code is p.ErrorCode.JOB_OVER:
            raise ClusterFailed(f"{what}: {reply.message}")
        if reply.code is p.ErrorCode.DESYNC:
            raise DesyncDetected(f"{what}: {reply.message}")
        if reply.code is p.ErrorCode.NOT_EXACT:
            raise NotExact(f"{what}: {reply.message}")
        if reply.code is p.ErrorCode.BAD_MESSAGE:
            raise ProtocolError(f"{what}: {reply.message}")
        raise RegistrationRejected(f"{what}: {reply.message}", code=reply.code.value, retry=reply.retry)
    return reply


@dataclass(slots=True)
class Identity:
    node_id: str
    incarnation: int
    rank: int


class SchedulerClient:
    """The request connection of one worker. Thread-safe (one request at a time)."""

    def __init__(self, address: Address, *, connect_timeout: float, secret: bytes | None = None):
        self.address = address
        self.connect_timeout = connect_timeout
        self.secret = secret
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self.identity: Identity | None = None

    def _call(self, msg, timeout: float | None = None, *, retry: bool = True, patience: float | None = None):
        """Send, reconnecting (and retrying idempotent requests) while the scheduler is away, for at most
        `patience` seconds (default: the connect timeout)."""
        deadline = time.monotonic() + (self.connect_timeout if patience is None else patience)
        with self._lock:
            while True:
                if self._conn is None:
                    self._conn = connect(self.address, deadline, secret=self.secret)
                try:
                    return self._conn.request(msg, timeout)
                except ProtocolError:
                    self._conn = None
                    raise
                except SchedulerUnavailable:
                    self._conn = None
                    if not retry or time.monotonic() > deadline:
                        raise
                    log.warning("scheduler connection lost; reconnecting")

    def register(self, *, node_id: str | None, host: str, pid: int, worker_num: int,
                 duplicate_wait: float | None = None) -> p.Registered:
        """Refusals that may clear (a predecessor not yet known dead, a quarantine) are retried until the
        connect timeout; a node id whose incarnation stays alive only for `duplicate_wait` seconds from the
        first such refusal (not from the first try: the time a restarting scheduler takes to answer at all
        does not count against it, since its clock for the predecessor starts when it is up)."""
        start = time.monotonic()
        deadline = start + self.connect_timeout
        delay = 0.1
        first_duplicate = None
        while True:
            reply = self._call(p.Register(node_id=node_id, host=host, pid=pid, worker_num=worker_num))
            limit = deadline
            if isinstance(reply, p.Error) and reply.code is p.ErrorCode.DUPLICATE and duplicate_wait is not None:
                first_duplicate = first_duplicate or time.monotonic()
                limit = min(deadline, first_duplicate + duplicate_wait)
            if isinstance(reply, p.Error) and reply.retry and time.monotonic() + delay < limit:
                log.warning("registration refused for now, retrying: %s", reply.message)
                time.sleep(delay)
                delay = min(1.0, delay * 2)
                continue
            waited = time.monotonic() - start
            still = f" (still, after {waited:.1f} s)" if waited >= 1 else ""
            reply = raise_for(reply, "registration refused" + still)
            self.identity = Identity(reply.node_id, reply.incarnation, reply.rank)
            return reply

    def _ident(self) -> Identity:
        assert self.identity is not None, "register first"
        return self.identity

    def join(self, after: int, timeout: float) -> p.Formed:
        me = self._ident()
        reply = self._call(p.Join(node_id=me.node_id, incarnation=me.incarnation, after=after, timeout=timeout),
                           timeout + 5.0)
        return raise_for(reply, "joining the cluster failed")

    def agree(self, generation: int, purpose: str, payload: Report, timeout: float) -> Decided:
        me = self._ident()
        msg = p.Agree(node_id=me.node_id, incarnation=me.incarnation, generation=generation, purpose=purpose,
                      payload=payload, timeout=timeout)
        return raise_for(self._call(msg, timeout + 5.0), f"agreeing on {purpose}").decision

    def report_failure(self, generation: int, kind: p.FailureKind, detail: str, at: p.Waiting | None = None) -> None:
        me = self._ident()
        msg = p.ReportFailure(node_id=me.node_id, incarnation=me.incarnation, generation=generation, kind=kind,
                              detail=detail[-8000:], at=at)
        reply = self._call(msg, 10.0)
        if isinstance(reply, p.Error) and reply.code is not p.ErrorCode.FENCED:
            raise_for(reply, "reporting a failure")

    def finish(self, ok: bool, detail: str = "", *, stopped: bool = False, patience: float | None = None) -> None:
        me = self._ident()
        self._call(p.Finish(node_id=me.node_id, incarnation=me.incarnation, ok=ok, detail=detail[-16000:],
                            stopped=stopped), 10.0, patience=patience)

    def store(self, msg: p.StoreOp) -> p.StoreReply:
        """One store operation, as this registered member (the scheduler refuses anyone else)."""
        if msg.node_id is None:
            me = self._ident()
            msg = msg.model_copy(update={"node_id": me.node_id, "incarnation": me.incarnation})
        return raise_for(self._call(msg, msg.timeout + 5.0, retry=False), f"rendezvous store {msg.op}")

    def status(self, patience: float | None = None) -> dict:
        return raise_for(self._call(p.Status(), 10.0, patience=patience), "status").state

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


class Heartbeater(threading.Thread):
    """Sends heartbeats on its own connection and records what the scheduler says; to the agent's relay
    instead when `relay` names its socket."""

    def __init__(self, address: Address, identity: Identity, interval: float, *, step_fn=lambda: -1,
                 on_news=lambda: None, secret: bytes | None = None, relay: str | None = None,
                 waits_fn=lambda: (None, None), on_hang=lambda why: None, on_beat=lambda: None,
                 on_stacks=lambda why: None):
        super().__init__(name="trainguard-heartbeat", daemon=True)
        self.address, self.identity, self.interval, self.secret = address, identity, interval, secret
        self.step_fn = step_fn
        self.waits_fn = waits_fn  # (the collective it waits in, seconds since its last progress)
        self.on_news = on_news  # called from this thread when the generation moves or we are fenced
        self.on_hang = on_hang  # called from this thread when the scheduler judged this worker hung
        self.on_beat = on_beat  # called from this thread after each answered heartbeat
        self.on_stacks = on_stacks  # called from this thread when the scheduler asks for this worker's stacks
        self.generation_seen = 0
        self.formed = False
        self.job_over = False
        self.verdict = 0  # the exit code of a verdict about the script that ended the job (exitcodes.VERDICTS)
        self.fenced = ""
        self.leaving = threading.Event()  # the worker says goodbye: a beat refused as "finished" is no error
        self.connected = threading.Event()
        self._halt = threading.Event()  # not `_stop`: that is Thread's own method, which a forked child
        # (a DataLoader worker) calls on every thread it inherited
        self._conn: Connection | None = None
        self.relay = relay

    def run(self) -> None:
        delay = BACKOFF_START_S
        while not self._halt.is_set():
            try:
                if self._conn is None:
                    self._conn = (LocalConnection(self.relay, 2.0) if self.relay else
                                  Connection(self.address, timeout=2.0, secret=self.secret))
                me = self.identity
                waiting, idle = self.waits_fn()
                reply = self._conn.request(p.Heartbeat(node_id=me.node_id, incarnation=me.incarnation,
                                                       generation=self.generation_seen, step=self.step_fn(),
                                                       waiting=waiting, idle=idle), 10.0)
                if isinstance(reply, p.Error) and reply.retry:  # the relay has no word from the scheduler yet
                    raise SchedulerUnavailable(reply.message)
                if isinstance(reply, p.Error):
                    self.fenced = reply.message
                    if not self.leaving.is_set():  # one in flight as the goodbye lands is refused: no error
                        log.error("scheduler refused heartbeat: %s", reply.message)
                    self.on_news()
                    return
                moved = reply.generation > self.generation_seen
                self.formed, self.job_over, self.verdict = reply.formed, reply.job_over, reply.verdict  # before
                # on_news: a collective it cuts loose sees why the job ends
                self.generation_seen = max(self.generation_seen, reply.generation)
                if moved:
                    self.on_news()
                if reply.hang:
                    self.on_hang(reply.hang)
                if reply.stacks:
                    self.on_stacks(f"generation {reply.generation} has waited long for this worker to join")
                self.on_beat()
                self.connected.set()
                delay = BACKOFF_START_S
                self._halt.wait(self.interval)
            except (SchedulerUnavailable, ProtocolError) as exc:
                self._conn = None
                self.connected.clear()
                log.debug("heartbeat: %s; retrying in %.2f s", exc, delay)
                self._halt.wait(delay)
                delay = min(BACKOFF_MAX_S, delay * 2)

    def stop(self) -> None:
        self._halt.set()
        if self._conn is not None:
            self._conn.close()


def report_exit(address: Address, node_id: str, pid: int, exit_code: int | None, signal: int | None,
                detail: str, timeout: float = 5.0, *, final: bool = False,
                secret: bytes | None = None) -> tuple[bool, str]:
    """From an agent: tell the scheduler a worker process exited. Best effort.
    Returns (taken, over): `over` is the scheduler's reason when that worker needs no replacement
    (it had already finished, or the job is over), else ""."""
    try:
        conn = Connection(address, timeout=timeout, secret=secret)
    except SchedulerUnavailable:
        return False, ""
    try:
        reply = conn.request(p.ProcessExited(node_id=node_id, pid=pid, exit_code=exit_code, signal=signal,
                                             detail=detail[-16000:], final=final), timeout)
        if isinstance(reply, p.Error) and reply.code is p.ErrorCode.JOB_OVER:
            return True, reply.message
        return True, ""
    except SchedulerUnavailable:
        return False, ""
    finally:
        conn.close()


def query_status(address: Address, timeout: float = 5.0, *, secret: bytes | None = None) -> dict:
    conn = Connection(address, timeout=timeout, secret=secret)
    try:
        return raise_for(conn.request(p.Status(), timeout), "status").state
    finally:
        conn.close()
