"""The agent's heartbeat relay: this host's workers beat to their agent, which sends the scheduler one
host beat per interval for all of them (control/hostmsgs.py).

At 10,000 workers a scheduler cannot take 20,000 heartbeats a second with a low latency (in Python,
one request costs tens of microseconds before any work); 1,250 host beats of 8 workers it can
(bench/scheduler_scale.py). It is on by default from RELAY_MIN_WORKERS workers in the job
(TG_HEARTBEAT_RELAY=auto), and can be forced on or off. Small jobs keep direct heartbeats: through the
relay a worker learns of a new generation up to one interval later (its ack is the agent's latest).

- **The channel.** A Unix stream socket in a directory of the agent's own (0700), named to the workers
  by TG_BEAT_SOCKET; the frames are the scheduler's own (a Heartbeat, answered with a HeartbeatAck or
  an Error). The relay serves only processes of this user that are the agent's own workers (the peer's
  pid and uid from SO_PEERCRED), and only beats for the node id that worker runs as.
- **Timing.** Each beat is answered at once from the last host beat's ack (the first waits for one);
  the next host beat carries every worker that beat since the last, with how long ago it beat, so the
  scheduler's silence clock is the worker's own: a hung worker is fenced within the heartbeat timeout
  and one interval.
- **Faults.** A worker's death is reported by the agent at once (process_exited), as without the relay.
  If the scheduler is away, the relay reconnects with backoff and the workers' beats are answered from
  the last ack meanwhile; a refused beat (a fenced incarnation) is answered with the scheduler's Error.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Mapping

from ..config import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    HEARTBEAT_INTERVAL_ENV,
    env_seconds,
    this_host,
)
from ..control import protocol as p
from ..control.client import BACKOFF_MAX_S, BACKOFF_START_S, Connection
from ..errors import (
    AuthenticationFailed,
    ConfigError,
    ProtocolError,
    SchedulerUnavailable,
)

log = logging.getLogger("trainguard.relay")

RELAY_ENV = "TG_HEARTBEAT_RELAY"  # auto (default) | on | off
RELAY_MIN_WORKERS = 64  # auto: relay from this many workers in the job
FIRST_ACK_WAIT_S = 10.0


def relay_wanted(setting: str | None, workers: int) -> bool:
    """Whether the agent relays its workers' heartbeats (pure)."""
    value = (setting or "auto").strip().lower()
    if value not in ("auto", "on", "off", "1", "0"):
        raise ConfigError(f"{RELAY_ENV}={setting!r} is invalid: use auto, on or off")
    if value == "auto":
        return workers >= RELAY_MIN_WORKERS
    return value in ("on", "1")


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


class BeatRelay:
    def __init__(self, address: tuple[str, int], host: str, interval: float, *, secret: bytes | None,
                 node_of_pid: Callable[[int], str | None]):
        self.address, self.host, self.interval, self.secret = address, host, interval, secret
        self.node_of_pid = node_of_pid  # the node id the agent's worker of that pid runs as, else None
        self.dir = Path(tempfile.mkdtemp(prefix="tg-beats-"))  # 0700
        self.path = str(self.dir / "beats.sock")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        self._server.listen(64)
        self._cond = threading.Condition()
        self._fresh: dict[str, tuple[int, int, float]] = {}  # node id -> (incarnation, step, when it beat)
        self._ack: p.HostBeatAck | None = None
        self._refused: dict[tuple[str, int], p.Error] = {}  # (node id, incarnation) -> the scheduler's refusal
        self._closed = False
        self._conn: Connection | None = None

    def start(self) -> None:
        threading.Thread(target=self._accept, name="tg-relay-accept", daemon=True).start()
        threading.Thread(target=self._forward, name="tg-relay-forward", daemon=True).start()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._server.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- this host's workers

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return  # closed
            pid, uid = peer_credentials(sock)
            node_id = self.node_of_pid(pid) if uid == os.getuid() else None
            if node_id is None:
                log.warning("heartbeat relay: refused a connection from pid %d (uid %d): not a worker of this agent",
                            pid, uid)
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock, node_id), name=f"tg-relay-{node_id}", daemon=True).start()

    def _serve(self, sock: socket.socket, node_id: str) -> None:
        try:
            while True:
                beat = p.decode_request(p.read_frame(sock))
                if not isinstance(beat, p.Heartbeat) or beat.node_id != node_id:
                    raise ProtocolError(f"worker {node_id} sent the heartbeat relay a {beat.type} for "
                                        f"{getattr(beat, 'node_id', '?')}")
                sock.sendall(p.encode(self._beat(beat)))
        except (OSError, ConnectionError, ProtocolError) as exc:
            log.debug("heartbeat relay: worker %s: %s", node_id, exc)
        finally:
            sock.close()

    def _beat(self, beat: p.Heartbeat):
        deadline = time.monotonic() + FIRST_ACK_WAIT_S
        with self._cond:
            self._fresh[beat.node_id] = (beat.incarnation, beat.step, time.monotonic())
            while self._ack is None and not self._closed and time.monotonic() < deadline:
                self._cond.notify_all()  # the forwarder sends at once
                self._cond.wait(deadline - time.monotonic())
            refused = self._refused.get((beat.node_id, beat.incarnation))
            if refused is not None:
                return refused
            ack = self._ack
        if ack is None:
            return p.Error(code=p.ErrorCode.TIMEOUT, message="the heartbeat relay has no word from the scheduler yet",
                           retry=True)
        return p.HeartbeatAck(generation=ack.generation, formed=ack.formed, job_over=ack.job_over)

    # --- the scheduler

    def _forward(self) -> None:
        delay = BACKOFF_START_S
        while True:
            with self._cond:
                if self._ack is not None:
                    self._cond.wait(self.interval)
                while not self._fresh and not self._closed:
                    self._cond.wait(self.interval)
                if self._closed:
                    return
                fresh, self._fresh = self._fresh, {}
            now = time.monotonic()
            beats = [p.Beat(node_id=n, incarnation=inc, step=step, age_ms=int((now - t) * 1000))
                     for n, (inc, step, t) in fresh.items()]
            try:
                if self._conn is None:
                    self._conn = Connection(self.address, timeout=2.0, secret=self.secret)
                ack = self._conn.request(p.HostBeat(host=self.host, beats=beats), 10.0)
            except (SchedulerUnavailable, ProtocolError) as exc:
                self._conn = None
                say = log.error if isinstance(exc, AuthenticationFailed) else log.debug  # a wrong secret: say so
                say("heartbeat relay: %s; retrying in %.2f s", exc, delay)
                with self._cond:  # keep them for the next try, unless a newer beat came
                    for node_id, got in fresh.items():
                        self._fresh.setdefault(node_id, got)
                    self._cond.wait(delay)
                delay = min(BACKOFF_MAX_S, delay * 2)
                continue
            delay = BACKOFF_START_S
            if isinstance(ack, p.Error):  # the whole host beat refused (a bad message): the workers beat on
                log.error("the scheduler refused this host's heartbeats: %s", ack.message)
                continue
            with self._cond:
                self._ack = ack
                self._refused = {(r.node_id, r.incarnation): p.Error(code=p.ErrorCode(r.code), message=r.message)
                                 for r in ack.refused}
                self._cond.notify_all()


def for_agent(env: Mapping[str, str], workers: int, address: tuple[str, int], secret: bytes | None,
              node_of_pid: Callable[[int], str | None]) -> BeatRelay | None:
    """The relay an agent runs for a job of `workers` workers, per TG_HEARTBEAT_RELAY; None: direct beats."""
    if not relay_wanted(env.get(RELAY_ENV), workers):
        return None
    interval = env_seconds(env, HEARTBEAT_INTERVAL_ENV, DEFAULT_HEARTBEAT_INTERVAL_S)
    return BeatRelay(address, this_host(), interval, secret=secret, node_of_pid=node_of_pid)
