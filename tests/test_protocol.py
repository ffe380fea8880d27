"""Frames and messages: every message round-trips; anything else is a ProtocolError that says why."""

from __future__ import annotations

import socket
import struct

import msgpack
import pytest

from trainguard.config import MAX_FRAME_BYTES
from trainguard.control import protocol as p
from trainguard.control.outcomes import (
    CopyKind,
    ErrorDecision,
    FinishDecision,
    RestoreDecision,
    Source,
    SourceKind,
)
from trainguard.control.reports import RestoreReport, ShardedRestoreReport
from trainguard.errors import ProtocolError

REQUESTS = [
    p.Register(node_id="w-0", host="hostA", pid=123, worker_num=4),
    p.Register(node_id=None, host="hostA", pid=0, worker_num=1),
    p.Reattach(node_id="3", incarnation=2, host="h", pid=9, worker_num=4),
    p.Heartbeat(node_id="a.b_c", incarnation=1, generation=0, step=-1),
    p.Join(node_id="0", incarnation=1, after=0, timeout=30.0),
    p.ReportFailure(node_id="0", incarnation=1, generation=3, kind=p.FailureKind.COLLECTIVE, detail="gloo: peer gone"),
    p.Agree(node_id="1", incarnation=5, generation=2, purpose="restore",
            payload={"step": None, "memory": {"0": [10, 9]}, "disk": [5], "shard": 1}, timeout=60.0),
    p.Finish(node_id="1", incarnation=1, ok=False, detail="Traceback ...\nRuntimeError: x"),
    p.ProcessExited(node_id="1", pid=77, exit_code=None, signal=9, detail=""),
    p.Status(),
    p.StoreOp(generation=1, op="set", keys=["trainguard/g1/k"], value=b"\x00\xffbytes"),
    p.StoreOp(generation=1, op="wait", keys=["a", "b"], timeout=1.5),
    p.StoreOp(generation=1, op="compare_set", keys=["k"], value=b"new", expected=b"old"),
]

REPLIES = [
    p.Registered(node_id="w-0", rank=0, incarnation=1, generation=1, worker_num=2),
    p.HeartbeatAck(generation=4, formed=True, job_over=False),
    p.Formed(generation=2, rank=1, world_size=2, local_rank=1, members=[
        p.Member(node_id="0", rank=0, host="h", pid=1, incarnation=1),
        p.Member(node_id="1", rank=1, host="h", pid=2, incarnation=3)]),
    p.Agreed(decision=RestoreDecision(step=12, from_step=13, sources=[
        Source(kind=SourceKind.MEMORY), Source(kind=SourceKind.PEER, peer=0, origin=CopyKind.LIVE)])),
    p.Agreed(decision=RestoreDecision(step=None, error="no step can be restored on every rank")),
    p.Agreed(decision=ErrorDecision(same=True, signatures=["ValueError: x"])),
    p.Agreed(decision=FinishDecision(ok=False, steps=[-1, 7])),
    p.StoreReply(value=b"v", number=3, flag=True),
    p.StatusReply(state={"generation": 1, "nodes": []}),
    p.Ok(),
    p.Error(code=p.ErrorCode.FULL, message="cluster full", retry=False),
]


def frame(payload: bytes, *, magic: bytes = p.MAGIC, version: int = p.PROTOCOL_VERSION,
          length: int | None = None) -> bytes:
    return p.HEADER.pack(magic, version, len(payload) if length is None else length) + payload


def split(data: bytes) -> tuple[int, bytes]:
    return p.parse_header(data[:p.HEADER.size]), data[p.HEADER.size:]


# --- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: m.type)
def test_every_request_round_trips(msg):
    data = p.encode(msg)
    assert data[:2] == b"TG" and data[2] == p.PROTOCOL_VERSION
    length, payload = split(data)
    assert length == len(payload) == struct.unpack(">I", data[3:7])[0]
    back = p.decode_request(payload)
    assert type(back) is type(msg) and back == msg


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: m.type)
def test_every_reply_round_trips(msg):
    back = p.decode_reply(split(p.encode(msg))[1])
    assert type(back) is type(msg) and back == msg


def test_a_decision_and_a_report_come_back_as_their_own_types_and_a_sources_kind_as_an_enum():
    back = p.decode_reply(split(p.encode(REPLIES[3]))[1]).decision
    assert type(back) is RestoreDecision and back.source(1).kind is SourceKind.PEER and back.source(1).peer == 0
    assert back.source(1).origin is CopyKind.LIVE and back.lost_steps == 1 and back.served_by(0) == [1]
    sharded = p.decode_request(split(p.encode(REQUESTS[6]))[1]).payload  # a restore report with a shard
    assert type(sharded) is ShardedRestoreReport and sharded.shard == 1 and sharded.memory == {"0": [10, 9]}
    plain = p.Agree(node_id="1", incarnation=1, generation=1, purpose="restore", payload={"step": 3, "disk": []},
                    timeout=1.0)
    assert type(p.decode_request(split(p.encode(plain))[1]).payload) is RestoreReport


@pytest.mark.parametrize("decision, where", [
    ({"purpose": "restore", "step": 1, "sources": [{"kind": "elsewhere"}]}, "decision.restore.sources.0.kind"),
    ({"purpose": "finish", "ok": True, "steps": [1], "extra": 1}, "decision.finish.extra"),
    ({"purpose": "vote", "ok": True}, "decision"),
    ({"purpose": "restore", "step": None, "sources": []}, "decision.restore"),  # neither a step nor an error
    ({"purpose": "restore", "step": 3, "sources": [{"kind": "peer"}]}, "decision.restore.sources.0"),  # from whom?
    ({"purpose": "restore", "step": 3, "sources": [{"kind": "peer", "peer": 5}]}, "decision.restore"),
    ({"purpose": "restore", "step": 3, "sources": [{"kind": "self", "peer": 0}]}, "decision.restore.sources.0"),
    ({"step": 1, "sources": []}, "decision"),
])
def test_a_decision_of_an_unknown_shape_is_refused_naming_the_field(decision, where):
    with pytest.raises(ProtocolError, match=f"invalid message \\(agreed.{where}"):
        p.decode_reply(msgpack.packb({"type": "agreed", "decision": decision}))


def test_requests_and_replies_are_separate_vocabularies():
    with pytest.raises(ProtocolError, match="invalid message"):
        p.decode_request(split(p.encode(p.Ok()))[1])
    with pytest.raises(ProtocolError, match="invalid message"):
        p.decode_reply(split(p.encode(p.Status()))[1])


def test_read_frame_over_a_socket_pair():
    a, b = socket.socketpair()
    with a, b:
        msgs = REQUESTS[:3]
        a.sendall(b"".join(p.encode(m) for m in msgs))
        assert [p.decode_request(p.read_frame(b)) for _ in msgs] == msgs
        a.close()
        with pytest.raises(ConnectionError):
            p.read_frame(b)


# --- bad frames ----------------------------------------------------------------------------------


def test_wrong_magic():
    with pytest.raises(ProtocolError, match="bad frame magic b'GE'.*trainguard protocol only"):
        p.parse_header(b"GET / H")


def test_wrong_protocol_version_names_both_versions():
    with pytest.raises(ProtocolError) as info:
        p.parse_header(p.HEADER.pack(p.MAGIC, p.PROTOCOL_VERSION + 1, 3))
    msg = str(info.value)
    assert f"version {p.PROTOCOL_VERSION + 1} is not supported" in msg and f"speaks {p.PROTOCOL_VERSION}" in msg
    assert "same trainguard version" in msg


def test_length_at_the_limit_is_accepted():
    assert p.parse_header(p.HEADER.pack(p.MAGIC, p.PROTOCOL_VERSION, MAX_FRAME_BYTES)) == MAX_FRAME_BYTES


def test_oversized_length_is_refused_before_the_body_is_read():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame(b"", length=MAX_FRAME_BYTES + 1) + b"body that must stay unread")
        with pytest.raises(ProtocolError, match=f"{MAX_FRAME_BYTES + 1} bytes exceeds"):
            p.read_frame(b)
        b.setblocking(False)
        assert b.recv(100) == b"body that must stay unread"  # only the 7-byte header was consumed


def test_oversized_message_is_refused_when_encoding():
    big = p.StoreOp(generation=1, op="set", keys=["k"], value=b"x" * (MAX_FRAME_BYTES + 1))
    with pytest.raises(ProtocolError, match="exceeds"):
        p.encode(big)


@pytest.mark.parametrize("payload", [b"\xc1", b"\x92\x01", b"\x81\xa1a"], ids=["never-used", "truncated", "half-map"])
def test_invalid_msgpack(payload):
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        p.decode_request(payload)


def test_the_container_budget_holds_on_both_sides_of_its_fast_path():
    """Every map and array takes a byte at least, so a payload of at most MAX_REQUEST_OBJECTS bytes is decoded
    without counting its containers; a longer one is counted, and one container over the budget is refused."""
    def maps_in_an_array(n: int) -> bytes:
        return b"\xdd" + struct.pack("!I", n) + b"\x80" * n  # array32 of n empty fixmaps: n + 1 containers

    budget = p.MAX_REQUEST_OBJECTS
    cases = [(budget - 5, "invalid message"),  # exactly `budget` bytes: the fast path
             (budget - 1, "invalid message"),  # counted: the budget exactly
             (budget, "too many maps")]  # counted: one over
    assert len(maps_in_an_array(budget - 5)) == budget
    for maps, refusal in cases:
        with pytest.raises(ProtocolError, match=refusal):
            p.decode_request(maps_in_an_array(maps))


def test_trailing_bytes_after_the_msgpack_object_are_refused():
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        p.decode_request(msgpack.packb({"type": "status"}) + b"\x00")


def test_non_string_map_keys_are_refused():
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        p.decode_request(msgpack.packb({1: "status"}))


@pytest.mark.parametrize("obj, where", [
    ({"type": "register", "host": "h", "pid": -1, "worker_num": 2}, "pid"),
    ({"type": "register", "host": "h", "pid": 1}, "worker_num"),
    ({"type": "register", "host": "h", "pid": 1, "worker_num": 2, "node_id": "bad id!"}, "node_id"),
    ({"type": "register", "host": "h", "pid": 1, "worker_num": 2, "admin": True}, "admin"),
    ({"type": "join", "node_id": "0", "incarnation": 1, "after": 0, "timeout": 0}, "timeout"),
    ({"type": "store", "generation": 1, "op": "set", "keys": []}, "one key"),
    ({"type": "store", "generation": 1, "op": "drop_all", "keys": ["k"]}, "op"),
    ({"type": "agree", "node_id": "0", "incarnation": 1, "generation": 1, "purpose": "x", "timeout": 1}, "purpose"),
])
def test_valid_msgpack_of_the_wrong_shape_says_which_field(obj, where):
    with pytest.raises(ProtocolError) as info:
        p.decode_request(msgpack.packb(obj, use_bin_type=True))
    msg = str(info.value)
    assert msg.startswith("invalid message") and where in msg, msg


@pytest.mark.parametrize("obj", [{"type": "shutdown"}, {"no": "type"}, [1, 2], 7, None, "register"])
def test_unknown_or_missing_type_is_refused(obj):
    with pytest.raises(ProtocolError, match="invalid message") as info:
        p.decode_request(msgpack.packb(obj))
    msg = str(info.value)
    assert "ValidationError" not in msg and "(:" not in msg, msg
    if isinstance(obj, dict) and "type" in obj:
        assert "'shutdown'" in msg and "'register'" in msg  # names the bad tag and the known ones


def test_an_error_raised_again_at_the_same_step_in_a_later_generation_is_deterministic():
    from trainguard.control.decisions import decide_agreement, raised_again
    from trainguard.control.reports import ErrorReport

    raised = {("builtins.NameError at train.py:9", 12): (0, 2)}  # rank 0 raised it at step 12 in generation 2
    again = raised_again(raised, ErrorReport(signature="builtins.NameError at train.py:9", step=12), 0, 3)
    assert again is not None and again.same
    assert again.reason == ("rank 0 raised it again at step 12, where it raised it before the job recovered and resumed "
                            "there")
    other = raised_again(raised, ErrorReport(signature="builtins.NameError at train.py:9", step=12), 2, 4)
    assert other is not None and other.reason.startswith("rank 2 raised it again at step 12, where rank 0 raised it")
    assert raised_again(raised, ErrorReport(signature="builtins.NameError at train.py:9", step=12), 1, 2) is None  # the
    # same generation: two ranks raising together are the vote's to judge, not a repeat
    assert raised_again(raised, ErrorReport(signature="builtins.NameError at train.py:9", step=13), 0, 3) is None
    assert raised_again(raised, ErrorReport(signature="builtins.KeyError at train.py:9", step=12), 0, 3) is None
    vote = decide_agreement("error", {0: ErrorReport(signature="s", step=4), 1: ErrorReport(signature="s", step=4)})
    assert vote.same and vote.reason == "every rank raised it at the same step"
