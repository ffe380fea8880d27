"""The base of every control-plane message (protocol.py, hostmsgs.py) and the field types they share."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


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
