"""Frames and messages between workers, agents and the scheduler.

A frame is  b"TG" | version (1 byte) | payload length (4 bytes, big-endian) | msgpack payload.
The payload is a map with a "type" key; pydantic validates every message on both sides.
Anything else (random bytes, a wrong version, an oversized length) is a ProtocolError
that closes that one connection and nothing more.
"""

from __future__ import annotations

import enum
import socket
import struct
from typing import Annotated, Literal, Union

import msgpack
from pydantic import (
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from ..config import MAX_FRAME_BYTES
from ..errors import ProtocolError
from .hostmsgs import (  # an agent's messages: placement under `recover`, its host's heartbeats
    AgentOrders,
    AgentPlace,
    AgentSync,
    Beat,  # noqa: F401  (p.Beat)
    HostBeat,
    HostBeatAck,
    Order,  # noqa: F401  (p.Order)
    Placed,
    Refused,  # noqa: F401  (p.Refused)
)
from .msgbase import (  # the base of every message, the field types
    MAX_WORKER_NUM,
    BeatStep,
    ExitCode,
    FixedRank,
    Generation,
    Host,
    Incarnation,
    Int64,
    Key,
    Msg,
    NodeId,
    NodeRank,
    Pid,
    SignalNum,
    Text,
    Wait,
    WorkerNum,
)
from .outcomes import Decision
from .reports import ErrorReport, FinishReport, RestoreReport, ShardedRestoreReport
from .waits import Seconds, Waiting

MAGIC = b"TG"
PROTOCOL_VERSION = 2  # 2: an agreement's decision is a typed model per purpose (outcomes.py)
HEADER = struct.Struct(">2sBI")


class ErrorCode(str, enum.Enum):
    BAD_MESSAGE = "bad_message"
    DUPLICATE = "duplicate"  # node id whose incarnation is still alive
    FULL = "full"  # more workers than TG_WORKER_NUM
    MISMATCH = "mismatch"  # job facts differ (worker count)
    QUARANTINED = "quarantined"  # node id keeps flapping
    FENCED = "fenced"  # stale generation or incarnation
    TIMEOUT = "timeout"
    JOB_OVER = "job_over"  # the job has finished or failed
    DESYNC = "desync"  # the job ended on a desync: the ranks called collectives that do not match (waits.py)
    NOT_EXACT = "not_exact"  # --exact strict: the job ended because a replayed step differed (train/engine/audit.py)
    UNKNOWN_NODE = "unknown_node"


class FailureKind(str, enum.Enum):
    EXITED = "exited"  # the agent saw the process exit
    CONNECTION = "connection"  # its control connection closed without a goodbye
    HEARTBEAT = "heartbeat"  # no heartbeat within the timeout (hang, SIGSTOP)
    COLLECTIVE = "collective"  # a survivor's collective failed
    EXCEPTION = "exception"  # the worker raised and gave up
    NOT_EXACT = "not_exact"  # --exact strict: a step it replayed differed from its first run (the job ends)
    DESYNC = "desync"  # its ranks' updates parted (train/engine/lockstep.py): a script bug (the job ends)


# --- requests -------------------------------------------------------------------


class Register(Msg):
    type: Literal["register"] = "register"
    node_id: NodeId | None = None
    host: Host
    pid: Pid
    worker_num: WorkerNum


class Reattach(Msg):
    type: Literal["reattach"] = "reattach"
    node_id: NodeId
    incarnation: Incarnation
    host: Host
    pid: Pid
    worker_num: WorkerNum


class Heartbeat(Msg):
    type: Literal["heartbeat"] = "heartbeat"
    node_id: NodeId
    incarnation: Incarnation
    generation: Generation
    step: BeatStep
    waiting: Waiting | None = None  # the collective it has been blocked in for a while (worker/ledger.py)
    idle: Seconds | None = None  # seconds since its last progress (a collective, a step, a batch)


class Join(Msg):
    """Ask to be part of the next formed generation newer than `after`; answered once all have joined."""

    type: Literal["join"] = "join"
    node_id: NodeId
    incarnation: Incarnation
    after: Generation
    timeout: Wait


class ReportFailure(Msg):
    type: Literal["report_failure"] = "report_failure"
    node_id: NodeId
    incarnation: Incarnation
    generation: Generation
    kind: FailureKind
    detail: str = Field(default="", max_length=8192)
    at: Waiting | None = None  # the collective that failed (a desync shows there: waits.py)


class Agree(Msg):
    """A barrier that also gathers one small document per rank; the scheduler returns its decision."""

    type: Literal["agree"] = "agree"
    node_id: NodeId
    incarnation: Incarnation
    generation: Generation
    purpose: Literal["restore", "finish", "error"]
    # each has a field the others lack (reports.py); a sharded report is a RestoreReport with a shard
    payload: RestoreReport | ShardedRestoreReport | FinishReport | ErrorReport
    timeout: Wait

    @model_validator(mode="after")
    def _report_for_purpose(self):
        want = REPORTS[self.purpose]
        if not isinstance(self.payload, want):
            raise ValueError(f"payload: an agree on {self.purpose!r} carries a {want.__name__}")
        return self


class Finish(Msg):
    type: Literal["finish"] = "finish"
    node_id: NodeId
    incarnation: Incarnation
    ok: bool
    detail: Text = ""
    stopped: bool = False  # a graceful exit at a commit point (signal): the job ends as stopped, not done


class ProcessExited(Msg):
    """From the launcher's agent: a worker process it watches has exited."""

    type: Literal["process_exited"] = "process_exited"
    node_id: NodeId
    pid: Pid
    exit_code: ExitCode | None = None
    signal: SignalNum | None = None
    detail: Text = ""
    final: bool = False  # the agent will not restart it (strategy or budget): the job fails with this root cause


class Status(Msg):
    type: Literal["status"] = "status"


class StoreOp(Msg):
    """torch.distributed Store operations, fenced by generation."""

    type: Literal["store"] = "store"
    generation: Generation
    node_id: NodeId | None = None  # who asks: only members of `generation` may use its store
    incarnation: Incarnation | None = None
    op: Literal["set", "get", "add", "check", "wait", "delete", "compare_set", "num_keys"]
    keys: list[Key] = Field(default_factory=list, max_length=4096)
    value: bytes = b""
    expected: bytes = b""
    amount: Int64 = 0  # torch's Store.add takes an int64; a sum that would leave it is refused (kvstore.py)
    timeout: Wait = 60.0

    @model_validator(mode="after")
    def _one_key(self):
        if self.op not in ("check", "wait", "num_keys") and len(self.keys) != 1:
            raise ValueError(f"store op {self.op!r} takes exactly one key")
        return self



REPORTS = {"restore": RestoreReport, "finish": FinishReport, "error": ErrorReport}

Request = Annotated[
    Union[Register, Reattach, Heartbeat, Join, ReportFailure, Agree, Finish, ProcessExited, Status, StoreOp,
          AgentSync, AgentPlace, HostBeat],
    Field(discriminator="type"),
]

# --- replies --------------------------------------------------------------------


class Member(Msg):
    node_id: NodeId
    rank: NodeRank
    host: Host
    pid: Pid
    incarnation: Incarnation


class Registered(Msg):
    type: Literal["registered"] = "registered"
    node_id: NodeId
    rank: FixedRank
    incarnation: Incarnation
    generation: Generation
    worker_num: WorkerNum


class HeartbeatAck(Msg):
    type: Literal["heartbeat_ack"] = "heartbeat_ack"
    generation: Generation
    formed: bool
    job_over: bool = False
    hang: Text = ""  # this worker made no progress while its peers waited: print its stacks and end (a fault)
    verdict: Annotated[int, Field(ge=0, le=255)] = 0  # the job ended on a verdict about the script (exitcodes.VERDICTS)
    stacks: bool = False  # a generation has waited long for this worker to join: print its stacks (and go on)


class Formed(Msg):
    type: Literal["formed"] = "formed"
    generation: Generation
    rank: NodeRank
    world_size: WorkerNum
    local_rank: NodeRank
    members: list[Member] = Field(max_length=MAX_WORKER_NUM)


class Agreed(Msg):
    type: Literal["agreed"] = "agreed"
    decision: Decision  # outcomes.py: one model per purpose


class StoreReply(Msg):
    type: Literal["store_reply"] = "store_reply"
    value: bytes = b""
    number: Int64 = 0
    flag: bool = False


class StatusReply(Msg):
    type: Literal["status_reply"] = "status_reply"
    state: dict


class Ok(Msg):
    type: Literal["ok"] = "ok"


class Error(Msg):
    type: Literal["error"] = "error"
    code: ErrorCode
    message: str = Field(max_length=1 << 20)  # a full cluster's reply names every node id
    retry: bool = False


Reply = Annotated[
    Union[Registered, HeartbeatAck, Formed, Agreed, StoreReply, StatusReply, AgentOrders, Placed, HostBeatAck, Ok,
          Error],
    Field(discriminator="type"),
]

_requests: TypeAdapter = TypeAdapter(Request)
_replies: TypeAdapter = TypeAdapter(Reply)


# --- codec ----------------------------------------------------------------------


def encode(msg: Msg) -> bytes:
    payload = msgpack.packb(msg.model_dump(mode="python"), use_bin_type=True)
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, len(payload)) + payload


MAX_REQUEST_BYTES = 4 << 20  # what the scheduler reads: requests are small (a store value is the largest)
MAX_REQUEST_OBJECTS = 100_000  # maps and arrays in one request: msgpack turns 1 byte into a 64-byte dict
MAX_REPLY_OBJECTS = 10_000_000


def parse_header(header: bytes, limit: int = MAX_FRAME_BYTES) -> int:
    """Length of the payload that follows, or ProtocolError (checked before anything more is read)."""
    magic, version, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {magic!r}: this port speaks the trainguard protocol only")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION}); "
            "run the same trainguard version on every process"
        )
    if length > limit:
        raise ProtocolError(f"frame of {length} bytes exceeds the {limit}-byte limit")
    return length


class _Budget:
    """Counts the maps and arrays msgpack builds; past the budget, decoding stops at once."""

    def __init__(self, limit: int):
        self.left = limit

    def __call__(self, obj):
        self.left -= 1
        if self.left < 0:
            raise ValueError("too many maps and arrays in one message")
        return obj


def _decode(payload: bytes, adapter: TypeAdapter, max_objects: int):
    # every map and array takes at least one byte: a payload no longer than the budget cannot exceed it, and
    # is decoded without a Python call per container (heartbeats and registrations, thousands a second)
    hooks = {}
    if len(payload) > max_objects:
        budget = _Budget(max_objects)
        hooks = {"object_hook": budget, "list_hook": budget}
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True, **hooks)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"payload is not valid msgpack: {exc}") from None
    try:
        return adapter.validate_python(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        what = f"{where}: {first.get('msg')}" if where else first.get("msg")
        raise ProtocolError(f"invalid message ({what})") from None


def decode_request(payload: bytes):
    return _decode(payload, _requests, MAX_REQUEST_OBJECTS)


def decode_reply(payload: bytes):
    return _decode(payload, _replies, MAX_REPLY_OBJECTS)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by the scheduler")
        buf += chunk
    return bytes(buf)


FRAME_READ_TIMEOUT_S = 10.0  # a started frame must arrive whole by then (a half-sent frame holds nothing longer)
TIMED_FRAME_BYTES = 64 * 1024  # frames above this are read under FRAME_READ_TIMEOUT_S (conn.py); a smaller one
# stalled holds at most this much (its connection counts against the scheduler's cap), and heartbeats and most
# requests are small: a timer for each of them cost the scheduler about 5% of its CPU at 10,000 workers


def read_frame(sock: socket.socket) -> bytes:
    length = parse_header(recv_exact(sock, HEADER.size))
    return recv_exact(sock, length)
