"""Simulated workers for load on a real scheduler: asyncio clients that speak the real wire protocol
(the job-secret handshake of control/auth.py, then frames of control/protocol.py) and nothing else.

Used by bench/scheduler_scale.py and tests/test_scheduler_scale.py, with `SchedulerUnderTest`, a
real scheduler process. Each connection is an asyncio.Protocol (`_Wire`), not a pair of streams. Frames
are encoded once per worker (a host beat once per set of members) and a reply equal to the last one is
not decoded again, so the clients, which share the machine with the scheduler they load, spend their
time on the socket, not on encoding.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import signal
import subprocess
import sys
from pathlib import Path

from ..control import auth
from ..control import protocol as p
from ..errors import AuthenticationFailed


class _Wire(asyncio.Protocol):
    """A client connection as a protocol: what arrives is kept until a read asks for it (a future per read,
    no task or stream per connection: the clients share the machine with the scheduler they load)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._want: tuple[asyncio.Future, bool, int] | None = None  # (the read, a frame?, bytes wanted)
        self._lost: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buf += data
        self._serve()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = exc or ConnectionError("the scheduler closed the connection")
        if self._want is not None and not self._want[0].done():
            self._want[0].set_exception(self._lost)
        self._want = None

    def read(self, n: int, frame: bool = False) -> asyncio.Future:
        """The next `n` bytes; with `frame`, the payload of the next frame (`n` unused)."""
        waiter = asyncio.get_running_loop().create_future()
        if self._lost is not None:
            waiter.set_exception(self._lost)
            return waiter
        self._want = (waiter, frame, n)
        self._serve()
        return waiter

    def _serve(self) -> None:
        if self._want is None:
            return
        waiter, frame, n = self._want
        start = 0
        if frame:
            if len(self._buf) < p.HEADER.size:
                return
            start, n = p.HEADER.size, p.HEADER.size + p.parse_header(bytes(self._buf[:p.HEADER.size]))
        if len(self._buf) < n:
            return
        data = bytes(self._buf[start:n])
        del self._buf[:n]
        self._want = None
        if not waiter.done():
            waiter.set_result(data)


class SimWorker:
    """One simulated worker (or agent): its own connection, one request at a time."""

    def __init__(self, node_id: str):
        self.node_id = node_id
        self.incarnation = 0
        self._wire: _Wire | None = None
        self._beat = b""
        self._host_beat: tuple[tuple, bytes] = ((), b"")  # (the members' (node id, incarnation)s, the frame)
        self._last_reply: tuple[bytes, object] = (b"", None)  # (payload, decoded)

    async def connect(self, host: str, port: int, secret: bytes | None) -> None:
        _, self._wire = await asyncio.get_running_loop().create_connection(_Wire, host, port)
        head = await self._wire.read(auth.HELLO_SIZE)
        mode, nonce_s = head[len(auth.MAGIC) + 1], head[len(auth.MAGIC) + 2:]
        if mode == 0:
            return
        if secret is None:
            raise AuthenticationFailed("the scheduler requires the job secret")
        nonce_c = os.urandom(auth.NONCE)
        self._wire.transport.write(nonce_c + auth.proof(secret, b"client", nonce_s, nonce_c))
        verdict = await self._wire.read(auth.VERDICT_SIZE)
        if verdict[0] != 1 or not hmac.compare_digest(verdict[1:], auth.proof(secret, b"server", nonce_s, nonce_c)):
            raise AuthenticationFailed("the scheduler refused the job secret")

    async def request_frame(self, frame: bytes):
        assert self._wire is not None, "connect first"
        self._wire.transport.write(frame)
        payload = await self._wire.read(0, frame=True)
        if payload != self._last_reply[0]:  # replies are frozen messages: the same bytes decode to an equal one
            self._last_reply = (payload, p.decode_reply(payload))
        return self._last_reply[1]

    async def register(self, worker_num: int, host: str = "sim") -> p.Registered | p.Error:
        reply = await self.request_frame(p.encode(p.Register(node_id=self.node_id, host=host, pid=0,
                                                             worker_num=worker_num)))
        if isinstance(reply, p.Registered):
            self.incarnation = reply.incarnation
            self._beat = p.encode(p.Heartbeat(node_id=self.node_id, incarnation=reply.incarnation, generation=0,
                                              step=-1))
        return reply

    async def heartbeat(self) -> p.HeartbeatAck | p.Error:
        assert self._beat, "register first"
        return await self.request_frame(self._beat)

    async def finish(self) -> p.Ok | p.Error:
        return await self.request_frame(p.encode(p.Finish(node_id=self.node_id, incarnation=self.incarnation,
                                                          ok=True)))

    async def host_beat(self, host: str, members: list[SimWorker]) -> p.HostBeatAck | p.Error:
        """As an agent: one heartbeat for `members` (those registered), as launch/relay.py sends it."""
        key = (host, *((w.node_id, w.incarnation) for w in members if w.incarnation))
        if key != self._host_beat[0]:
            beats = [p.Beat(node_id=node_id, incarnation=inc, step=-1, age_ms=0) for node_id, inc in key[1:]]
            self._host_beat = (key, p.encode(p.HostBeat(host=host, beats=beats)))
        return await self.request_frame(self._host_beat[1])

    def close(self) -> None:
        if self._wire is not None:
            self._wire.transport.close()
            self._wire = None


class SchedulerUnderTest:
    """A real `trainguard scheduler` process on 127.0.0.1 (port 0: the OS picks; --port-fd tells it)."""

    def __init__(self, workers: int, recovery: Path | None, secret_file: Path, *, port: int = 0,
                 log: Path | None = None, env: dict[str, str] | None = None):
        env = {**os.environ, **(env or {}), "TG_JOB_SECRET_FILE": str(secret_file), "PYTHONUNBUFFERED": "1",
               "TG_ENABLE_RECOVERY": "1" if recovery else "0"}
        if recovery:
            env["TG_RECOVERY_PATH"] = str(recovery)
        reader, writer = os.pipe()
        self.log = open(log, "ab") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard", "scheduler", "--host", "127.0.0.1", "--port", str(port),
             "--workers", str(workers), "--port-fd", str(writer)],
            env=env, pass_fds=(writer,), stdout=self.log, stderr=self.log)
        os.close(writer)
        line = b""
        while not line.endswith(b"\n"):
            chunk = os.read(reader, 64)
            if not chunk:
                raise RuntimeError(f"the scheduler exited with {self.proc.wait()} before it listened (log: {log})")
            line += chunk
        os.close(reader)
        self.port = int(line)

    def rss_mb(self) -> float:
        for row in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if row.startswith("VmRSS:"):
                return int(row.split()[1]) / 1024
        return float("nan")

    def cpu_s(self) -> float:
        """CPU seconds the scheduler has used (user + system)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        if self.log is not subprocess.DEVNULL:
            self.log.close()
