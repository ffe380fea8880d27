"""A seeded fuzzer for the scheduler's wire, used by tests/test_scheduler_bounds.py (about 30 s) and
bench/fuzz_scheduler.py (a million frames).

It plays clients that hold the job secret (so their frames reach the handlers), clients that hold a
worker's secret, and strangers (no secret, a wrong one: their frames must reach nothing). Each
connection sends a batch of frames pipelined, then reads the answers until the scheduler has answered
them all or closed the connection (it closes one on a malformed frame). A frame is one of:
- `member`: a request of a member the fuzzer registered (its real node id and incarnation), with fuzzed
  numbers: heartbeats, joins, agreements, store operations, failure reports; a fenced member registers
  again, so these go on reaching the state machine;
- `extreme`: a well-formed request whose numbers are the edges of int64 and of every bound (msgbase.py);
- `random`: a map of a message type and random fields of random values;
- `mutated`: a valid frame with a few bytes changed.
Frames never finish the job or stop a member's process: a fuzzed Finish or exit carries a node id that no
member has. What it counts is in `Tally`; what it checks between batches is the caller's (`status_ok`).
"""

from __future__ import annotations

import random
import socket
import time
from dataclasses import dataclass, field

import msgpack

from ..config import MAX_SLOTS, MAX_WORKER_NUM
from ..control import auth
from ..control import protocol as p
from ..control.msgbase import INT64_MAX, MAX_INCARNATION
from ..errors import ProtocolError

EDGES = [-(1 << 63), -(1 << 31), -2, -1, 0, 1, 2, 3, 255, 256, (1 << 22), (1 << 22) + 1, MAX_SLOTS, MAX_SLOTS + 1,
         MAX_WORKER_NUM - 1, MAX_WORKER_NUM, MAX_INCARNATION, MAX_INCARNATION + 1, (1 << 53) + 1, INT64_MAX,
         INT64_MAX + 1, (1 << 64) - 1]
TYPES = ["register", "reattach", "heartbeat", "join", "report_failure", "agree", "finish", "process_exited",
         "status", "store", "agent_sync", "agent_place", "host_beat", "bogus"]
FIELDS = ["node_id", "incarnation", "generation", "host", "pid", "worker_num", "step", "purpose", "payload",
          "timeout", "op", "keys", "value", "amount", "kind", "detail", "exit_code", "signal", "after", "agent",
          "slots", "running", "handled", "beats", "in_place_ok", "final", "ok", "stopped", "expected"]
STORE_OPS = ["set", "get", "add", "check", "wait", "delete", "compare_set", "num_keys"]
MEMBER_PREFIX = "fz-member-"  # a fuzzed node id never starts so: random ones are at most 8 characters
TOGETHER = 0.05  # batches that begin with every member sending the same join or agreement
STRANGER_PREFIX = "stranger-"  # registered only by clients without the secret: none may ever appear


@dataclass
class Tally:
    frames: int = 0  # frames written on an admitted connection
    answered: int = 0  # answers read
    unauthenticated: int = 0  # frames written by strangers (never answered)
    connections: int = 0
    dropped: int = 0  # connections the scheduler closed (a malformed frame)
    kinds: dict[str, int] = field(default_factory=dict)


class Fuzzer:
    def __init__(self, address: tuple[str, int], secret: bytes, worker_num: int, *, seed: int, members: int = 2):
        self.address, self.secret, self.worker_num = address, secret, worker_num
        self.rng = random.Random(seed)
        self.tally = Tally()
        self.members = {f"{MEMBER_PREFIX}{i}": 0 for i in range(members)}  # node id -> incarnation (0: none)
        self.generation = 1

    # --- values -----------------------------------------------------------------------------------

    def number(self) -> int:
        r = self.rng
        return r.choice(EDGES) if r.random() < 0.7 else r.randint(-(1 << 63), (1 << 64) - 1)

    def scalar(self):
        r = self.rng
        pick = r.randrange(7)
        if pick == 0:
            return None
        if pick == 1:
            return r.random() < 0.5
        if pick == 2:
            return self.number()
        if pick == 3:
            return r.choice([0.0, -1.0, 1e-9, 1e308, float("inf"), float("nan"), r.random()])
        if pick == 4:
            return "".join(chr(r.choice([r.randrange(32, 127), r.randrange(0, 0x2FFF)])) for _ in range(r.randrange(9)))
        if pick == 5:
            return r.choice(["x" * 64, "x" * 65, "x" * 256, "0", "1", "restore", "finish", "error", "set", "add"])
        return r.randbytes(r.randrange(9))

    def value(self, depth: int = 0):
        r = self.rng
        if depth < 2 and r.random() < 0.2:
            if r.random() < 0.5:
                return [self.value(depth + 1) for _ in range(r.randrange(5))]
            return {str(self.scalar())[:8]: self.value(depth + 1) for _ in range(r.randrange(5))}
        return self.scalar()

    def payload(self) -> dict:
        r = self.rng
        shape = r.randrange(4)
        if shape == 0:
            return {"step": r.choice([None, self.number()]), "disk": [self.number() for _ in range(r.randrange(4))],
                    **({"shard": self.number(), "memory": {str(r.randrange(12)): [self.number()]}} if r.random() < .5
                       else {})}
        if shape == 1:
            return {"step": self.number()}
        if shape == 2:
            return {"signature": "x" * r.choice([1, 1024, 1025]), "step": self.number()}
        return {str(self.scalar())[:8]: self.value() for _ in range(r.randrange(3))}

    # --- frames -------------------------------------------------------------------------------------

    def random_request(self) -> dict:
        r = self.rng
        req = {"type": r.choice(TYPES)}
        for name in r.sample(FIELDS, r.randrange(len(FIELDS) // 2)):
            req[name] = self.value()
        if "timeout" in req:
            req["timeout"] = r.choice([0.001, 0.01, -1.0, 0.0])  # a long wait would only stall this connection
        return req

    def extreme_request(self) -> dict:
        r, n = self.rng, self.number
        t = r.choice(TYPES[:-1])
        node = r.choice([f"x{r.randrange(100)}", "y" * 64])
        base = {"type": t, "node_id": node, "incarnation": n(), "generation": n(), "timeout": 0.001}
        extra = {
            "register": {"host": "h" * r.choice([255, 256]), "pid": n(), "worker_num": n()},
            "reattach": {"host": "h", "pid": n(), "worker_num": n()},
            "heartbeat": {"step": n()},
            "join": {"after": n()},
            "report_failure": {"kind": "exited", "detail": "d" * r.choice([8192, 8193])},
            "agree": {"purpose": r.choice(["restore", "finish", "error"]), "payload": self.payload()},
            "finish": {"ok": r.random() < 0.5, "detail": "d" * r.choice([16384, 16385])},
            "process_exited": {"pid": n(), "exit_code": n(), "signal": n()},
            "status": {},
            "store": {"op": r.choice(STORE_OPS), "keys": ["k"], "value": str(n()).encode(), "amount": n()},
            "agent_sync": {"agent": n(), "host": "h", "slots": n(), "running": [node] * r.choice([1, 4097]),
                           "handled": [n() for _ in range(3)]},
            "agent_place": {"agent": n(), "in_place_ok": True},
            "host_beat": {"host": "h", "beats": [{"node_id": node, "incarnation": n(), "step": n(), "age_ms": n()}]},
        }[t]
        req = {**base, **extra}
        if t in ("status", "agent_sync", "agent_place", "host_beat"):
            req = {k: v for k, v in req.items() if k in ("type", *extra) or (t == "agent_place" and k == "node_id")}
        return req

    def member_request(self) -> dict:
        """A member's request with fuzzed numbers; a member not registered yet registers."""
        r, n = self.rng, self.number
        node = r.choice(sorted(self.members))
        inc = self.members[node]
        if inc == 0:
            return {"type": "register", "node_id": node, "host": "fuzz-host", "pid": 0, "worker_num": self.worker_num}
        me = {"node_id": node, "incarnation": inc}
        good = r.choice([1, 2, n()])  # a generation: mostly one that may be current
        t = r.choice(["heartbeat", "heartbeat", "join", "agree", "store", "store", "report_failure", "reattach"])
        if t == "heartbeat":
            return {"type": t, **me, "generation": good, "step": r.choice([-1, 0, 5, n()])}
        if t == "join":
            return {"type": t, **me, "after": r.choice([0, 1, n()]), "timeout": 0.01}
        if t == "agree":
            return {"type": t, **me, "generation": good, "purpose": r.choice(["restore", "finish", "error"]),
                    "payload": self.payload(), "timeout": 0.01}
        if t == "store":
            op = r.choice(STORE_OPS)
            keys = [r.choice(["a", "b", "n"])] if op not in ("check", "wait", "num_keys") else ["a", "n"]
            return {"type": t, **me, "generation": good, "op": op, "keys": keys, "timeout": 0.01,
                    "value": r.choice([b"1", str(INT64_MAX).encode(), r.randbytes(4)]), "amount": n()}
        if t == "reattach":
            return {"type": t, **me, "host": "fuzz-host", "pid": 0, "worker_num": self.worker_num}
        return {"type": t, **me, "generation": good, "kind": r.choice(["exited", "collective", "bogus"]),
                "detail": "fuzzed"}

    def frame(self) -> tuple[str, bytes]:
        r = self.rng
        kind = r.choices(["member", "extreme", "random", "mutated"], weights=[4, 3, 2, 1])[0]
        req = {"member": self.member_request, "extreme": self.extreme_request}.get(kind, self.random_request)()
        try:
            body = msgpack.packb(req, use_bin_type=True)
        except (OverflowError, ValueError, TypeError):  # a value msgpack cannot carry: send what it can
            body = msgpack.packb({"type": req.get("type")}, use_bin_type=True)
        if kind == "mutated":
            raw = bytearray(body)
            for _ in range(r.randrange(1, 5)):
                raw[r.randrange(len(raw))] = r.randrange(256)
            body = bytes(raw)
        self.tally.kinds[kind] = self.tally.kinds.get(kind, 0) + 1
        return kind, p.HEADER.pack(p.MAGIC, p.PROTOCOL_VERSION, len(body)) + body

    # --- connections --------------------------------------------------------------------------------

    def together(self) -> None:
        """Every registered member sends the same join or agreement at once, each on its own connection (a
        connection's requests are answered in order): generations form and agreements are decided."""
        r = self.rng
        ids = [m for m, inc in sorted(self.members.items()) if inc]
        if len(ids) < len(self.members):
            return
        kind = r.choice(["join", "restore", "finish", "error"])
        socks = []
        try:
            for node in ids:
                sock = socket.create_connection(self.address, timeout=10.0)
                socks.append(sock)
                socks[-1] = sock = auth.client_handshake(sock, self.secret, "the fuzzed scheduler")
                me = {"node_id": node, "incarnation": self.members[node], "timeout": 0.5}
                if kind == "join":
                    req = {"type": "join", **me, "after": self.generation}
                else:
                    step = r.choice([0, 1, INT64_MAX])
                    report = {"restore": {"step": step, "disk": [INT64_MAX] * r.randrange(3)},
                              "finish": {"step": step}, "error": {"signature": "s", "step": step}}[kind]
                    req = {"type": "agree", **me, "generation": self.generation, "purpose": kind, "payload": report}
                body = msgpack.packb(req, use_bin_type=True)
                sock.sendall(p.HEADER.pack(p.MAGIC, p.PROTOCOL_VERSION, len(body)) + body)
                self.tally.frames += 1
                self.tally.kinds["together"] = self.tally.kinds.get("together", 0) + 1
            for sock in socks:
                self._read_answers(sock, [("together", b"")])
        finally:
            for sock in socks:
                sock.close()

    def batch(self, size: int) -> None:
        """One connection: admitted (the job secret, or a worker's) or a stranger's, `size` frames."""
        r = self.rng
        if r.random() < TOGETHER:
            self.together()
        self.tally.connections += 1
        who = r.choices(["agent", "worker", "stranger"], weights=[6, 3, 1])[0]
        sock = socket.create_connection(self.address, timeout=10.0)
        try:
            if who == "stranger":
                self._stranger(sock, size)
                return
            secret = self.secret if who == "agent" else auth.worker_secret(self.secret)
            sock = auth.client_handshake(sock, secret, "the fuzzed scheduler")
            frames = self._ordered([self.frame() for _ in range(size)])
            sock.sendall(b"".join(f for _, f in frames))
            self.tally.frames += len(frames)
            self._read_answers(sock, frames)
        finally:
            sock.close()

    @staticmethod
    def _ordered(frames: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        """The frames this side's own decoder accepts, then one it refuses, if any: the scheduler closes the
        connection at a malformed frame, so every frame sent is read."""
        good, bad = [], []
        for item in frames:
            try:
                p.decode_request(item[1][p.HEADER.size:])
                good.append(item)
            except ProtocolError:
                bad.append(item)
        return good + bad[:1]

    def _stranger(self, sock: socket.socket, size: int) -> None:
        """No secret or a wrong one, then registrations no scheduler may ever accept."""
        sock.recv(auth.HELLO_SIZE, socket.MSG_WAITALL)
        if self.rng.random() < 0.5:
            sock.sendall(self.rng.randbytes(auth.ANSWER_SIZE))  # a wrong answer to the challenge
        reg = {"type": "register", "node_id": f"{STRANGER_PREFIX}{self.rng.randrange(1000)}", "host": "h", "pid": 0,
               "worker_num": self.worker_num}
        body = msgpack.packb(reg, use_bin_type=True)
        try:
            sock.sendall((p.HEADER.pack(p.MAGIC, p.PROTOCOL_VERSION, len(body)) + body) * size)
        except OSError:  # refused and closed already
            pass
        self.tally.unauthenticated += size

    def _read_answers(self, sock: socket.socket, frames: list[tuple[str, bytes]]) -> None:
        for i in range(len(frames)):
            try:
                reply = p.decode_reply(p.read_frame(sock))
            except (OSError, ConnectionError):
                self.tally.dropped += 1
                return
            self.tally.answered += 1
            self._learn(frames[i][1], reply)

    def _learn(self, frame: bytes, reply) -> None:
        """Keep the members' identities and the generation current: a registration's answer, a formed
        generation, or a fence that asks for a new registration."""
        if isinstance(reply, (p.Formed, p.HeartbeatAck, p.Registered)):
            self.generation = reply.generation
        try:
            req = msgpack.unpackb(frame[p.HEADER.size:], raw=False)
        except Exception:  # a mutated frame: the reply was an error
            return
        node = req.get("node_id") if isinstance(req, dict) else None
        if not isinstance(node, str) or node not in self.members:
            return
        if isinstance(reply, p.Registered):
            self.members[node] = reply.incarnation
        elif isinstance(reply, p.Error) and reply.code in (p.ErrorCode.FENCED, p.ErrorCode.UNKNOWN_NODE):
            self.members[node] = 0


def run(fuzzer: Fuzzer, *, frames: int, seconds: float, batch: int, check, check_every_s: float = 0.0) -> Tally:
    """Batches until `frames` frames or `seconds` have passed; `check()` after every batch (or at most every
    `check_every_s`), which raises to stop the run."""
    t0 = last = time.monotonic()
    while fuzzer.tally.frames + fuzzer.tally.unauthenticated < frames and time.monotonic() - t0 < seconds:
        fuzzer.batch(fuzzer.rng.randrange(1, 2 * batch))
        now = time.monotonic()
        if now - last >= check_every_s:
            check()
            last = now
    return fuzzer.tally


@dataclass
class Outcome:
    tally: Tally
    seconds: float
    handler_errors: list[str]  # the scheduler's log lines that say a request's handler failed
    hangs: int  # status queries not answered within the limit
    crashed: bool
    peak_rss_mb: float
    strangers: list[str]  # node ids registered by clients without the secret (must stay empty)
    slowest_status_s: float


def fuzz_scheduler(workdir, *, seed: int, frames: int, seconds: float, batch: int = 24, check_every_s: float = 0.0,
                   status_limit_s: float = 10.0, worker_num: int = 2) -> Outcome:
    """A real `trainguard scheduler` process holding a job secret, fuzzed; `status` is queried after every batch
    (at most every `check_every_s`)."""
    from pathlib import Path

    from ..control.client import query_status
    from ..errors import TrainguardError
    from .simworkers import SchedulerUnderTest

    workdir = Path(workdir)
    secret_file = workdir / "job.secret"
    secret_file.write_text("fuzz-secret-" + "s" * 32)
    secret_file.chmod(0o600)
    secret = secret_file.read_text().encode()
    log = workdir / "scheduler.log"
    sched = SchedulerUnderTest(worker_num, workdir / "recovery", secret_file, log=log,
                               env={"TG_HEARTBEAT_TIMEOUT": "3", "TG_HEARTBEAT_INTERVAL": "0.5"})
    address = ("127.0.0.1", sched.port)
    hangs, slowest, crashed = 0, 0.0, False

    def check() -> None:
        nonlocal hangs, slowest
        t0 = time.monotonic()
        try:
            query_status(address, timeout=status_limit_s, secret=secret)
        except (TrainguardError, OSError):
            hangs += 1
            if sched.proc.poll() is not None:
                raise
        slowest = max(slowest, time.monotonic() - t0)

    fuzzer = Fuzzer(address, secret, worker_num, seed=seed)
    t0 = time.monotonic()
    try:
        run(fuzzer, frames=frames, seconds=seconds, batch=batch, check=check, check_every_s=check_every_s)
        check()
        nodes = query_status(address, timeout=status_limit_s, secret=secret)["nodes"]
    except (TrainguardError, OSError):
        crashed, nodes = sched.proc.poll() is not None, []
    took = time.monotonic() - t0
    peak = _peak_rss_mb(sched.proc.pid)
    sched.kill()
    errors = [line for line in log.read_text(errors="replace").splitlines()
              if " ERROR: " in line and "request from" in line]
    return Outcome(fuzzer.tally, took, errors, hangs, crashed, peak,
                   [n["node_id"] for n in nodes if n["node_id"].startswith(STRANGER_PREFIX)], slowest)


def _peak_rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for row in f:
                if row.startswith("VmHWM:"):
                    return int(row.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")
