"""The base of every control-plane message (protocol.py, hostmsgs.py) and the field types they share."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from ..config import MAX_SLOTS, MAX_WORKER_NUM


class Msg(BaseModel):
    """Frozen, and no field beyond those declared: an unknown key is a ProtocolError."""

    model_config = ConfigDict(extra="forbid", frozen=True)


NodeId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
Key = Annotated[str, Field(min_length=1, max_length=1024)]
# a host name that reaches logs: no control characters (a "\n" would forge log lines)
Host = Annotated[str, Field(max_length=255, pattern=r"^[^\x00-\x1f\x7f]*$")]
_CONTROL = {c: f"\\x{c:02x}" for c in range(32) if c not in (9, 10)} | {0x7F: "\\x7f"}


def for_log(text: str) -> str:
    """A peer's free text (a failure's detail, a traceback) as it may reach a log: control characters escaped,
    and every line after the first indented under "  | ", so no line of it can pass for one of ours."""
    return text.translate(_CONTROL).replace("\n", "\n  | ")


# a pid the scheduler may signal: within Linux's pid_max (2**22), so os.kill and sqlite never overflow
Pid = Annotated[int, Field(ge=0, le=1 << 22)]

# --- numbers: every integer a peer sends has a range, so that nothing the scheduler keeps, sums or reports
# (status, metrics, events.jsonl, cluster.db) can leave int64 (msgpack, sqlite) or plan with a count no
# machine has. A value outside is a ProtocolError that names the field and the range (protocol._decode).
INT64_MAX = (1 << 63) - 1
MAX_INCARNATION = (1 << 31) - 1  # restarts of one node id; the scheduler adds 1 to it, sqlite keeps it
MAX_WAIT_S = 7 * 86400.0  # the longest a request may ask the scheduler to wait (join, agree, store)

WorkerNum = Annotated[int, Field(ge=1, le=MAX_WORKER_NUM)]
NodeRank = Annotated[int, Field(ge=0, lt=MAX_WORKER_NUM)]  # a rank or an agent's node rank; the scheduler
# also checks it against the job's own worker count (bounds.py)
FixedRank = Annotated[int, Field(ge=-1, lt=MAX_WORKER_NUM)]  # a node's rank in the job; -1 until it first forms
Slots = Annotated[int, Field(ge=1, le=MAX_SLOTS)]
Incarnation = Annotated[int, Field(ge=1, le=MAX_INCARNATION)]
Generation = Annotated[int, Field(ge=0, le=INT64_MAX)]
Step = Annotated[int, Field(ge=0, le=INT64_MAX)]  # a committed step
BeatStep = Annotated[int, Field(ge=-1, le=INT64_MAX)]  # a heartbeat's step; -1: not training yet
Seq = Annotated[int, Field(ge=0, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
ExitCode = Annotated[int, Field(ge=-255, le=255)]  # Popen's returncode: 0..255, or -signal
SignalNum = Annotated[int, Field(ge=1, le=128)]
Wait = Annotated[float, Field(gt=0, le=MAX_WAIT_S, allow_inf_nan=False)]  # seconds
Text = Annotated[str, Field(max_length=16384)]  # free text (a reason, a traceback's last lines)
