"""The messages between an agent and its zygote (zygote.py, forked.py): one JSON object per packet of a
private `AF_UNIX`/`SOCK_SEQPACKET` socket pair, file descriptors riding along with `SCM_RIGHTS`.

Who may send: only the two ends of the pair. The agent makes it with `socketpair()` and hands one end to
the zygote it starts; nothing is bound to a name, so no other process can connect, and every forked
child closes its copy before it runs a line of the user's script. A malformed packet is still refused
(`ProtocolError`): the zygote ends, the agent stops using it and starts fresh processes.

agent -> zygote:  {"op": "fork", "id": N, "main": MODULE, "argv": [...], "env": {...}, "fds": [TARGET, ...]}
                  with the descriptors to place at 0, 1, 2 and each TARGET, in that order
zygote -> agent:  {"op": "ready", "unsafe": "" or why forking is not safe}
                  {"op": "forked", "id": N, "pid": PID} or {"op": "refused", "id": N, "error": "..."}
                  {"op": "exit", "pid": PID, "returncode": RC}   (RC < 0: killed by signal -RC, as Popen has it)
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from ..errors import ProtocolError

ZYGOTE_MODULE = "trainguard.launch.zygote"
MAINS = ("trainguard.launch.worker_main", "trainguard.launch.spare_main")  # what a forked child may run
MAX_TARGET = 1023  # highest descriptor number a child may be given
MAX_PACKET = 1 << 20  # an environment of 1 MiB is far past any real one
MAX_FDS = 16


def pair() -> tuple[socket.socket, socket.socket]:
    """(the agent's end, the zygote's end); the zygote's end is inheritable, to pass it to the zygote."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.set_inheritable(True)
    return mine, theirs


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_PACKET:
        raise ProtocolError(f"a zygote message of {len(data)} bytes is over the {MAX_PACKET}-byte bound")
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """The next message and the descriptors that came with it (now owned by the caller); None at EOF."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_PACKET + 1, MAX_FDS)
    if not data and not fds:
        return None
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) > MAX_PACKET:
            raise ProtocolError("a zygote message was cut short (too long, or too many descriptors)")
        try:
            message = json.loads(data)
        except ValueError as exc:
            raise ProtocolError(f"a zygote message is not JSON: {exc}") from None
        if not isinstance(message, dict) or not isinstance(message.get("op"), str):
            raise ProtocolError("a zygote message is not an object with an 'op'")
    except ProtocolError:
        for fd in fds:
            os.close(fd)
        raise
    return message, fds


def field(message: dict[str, Any], name: str, kind: type) -> Any:
    """message[name], checked to be of `kind` (bool is not an int here)."""
    value = message.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"zygote message {message.get('op')!r}: {name!r} is not a {kind.__name__}")
    return value
