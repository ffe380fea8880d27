"""Cutting a gloo group's connections, so that collectives blocked on it fail at once.

gloo has no abort: `destroy_process_group()`, `ProcessGroup.abort()` and `shutdown()` leave
its TCP connections open (tested with torch 2.13), so a peer blocked in a collective with us
waits for the whole collective timeout (120 s by default) when we leave the group alive, e.g.
because another rank died and we went to regroup. Shutting down the group's connected
sockets ends that wait in milliseconds on both sides: the peer's blocked operation fails with
"Connection closed by peer", and so does one of our own if another thread cuts.

The sockets are the ones that appeared while the group was built, less the connections to the
scheduler (its rendezvous runs then) and less gloo's listening socket (gloo aborts the process
if its listener fails). Each is identified by fd *and* inode, so a number that gloo closed and
the kernel handed to a new socket is never touched. NCCL has a real abort and needs none of this.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

log = logging.getLogger("trainguard.sever")

_FD_DIR = "/proc/self/fd"


def open_sockets() -> dict[int, str]:
    """fd -> 'socket:[inode]' for every socket this process holds (empty where /proc is missing)."""
    found: dict[int, str] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return found
    for name in names:
        try:
            link = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:"):
            found[int(name)] = link
    return found


def _peer(sock: socket.socket) -> tuple[str, int] | None:
    try:
        addr = sock.getpeername()
    except OSError:
        return None
    return (addr[0], addr[1]) if isinstance(addr, tuple) else None


class GroupSockets:
    """The connections of one process group; `sever()` is idempotent and thread-safe."""

    def __init__(self, fds: dict[int, str]):
        self._fds = dict(fds)
        self._lock = threading.Lock()

    @classmethod
    def since(cls, before: dict[int, str], *, exclude_peers: set[tuple[str, int]]) -> "GroupSockets":
        """The sockets opened since `before`, less listeners and connections to `exclude_peers`."""
        kept: dict[int, str] = {}
        for fd, link in open_sockets().items():
            if before.get(fd) == link:
                continue
            try:
                with socket.socket(fileno=os.dup(fd)) as sock:
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        continue
                    peer = _peer(sock)
            except OSError:  # another thread closed it since the listing (its number may name a file now)
                continue
            if peer is None or peer in exclude_peers:
                continue
            kept[fd] = link
        return cls(kept)

    def add(self, other: "GroupSockets") -> None:
        """Cut `other`'s connections with these from now on."""
        with self._lock, other._lock:
            self._fds.update(other._fds)

    def __len__(self) -> int:
        return len(self._fds)

    def sever(self, why: str) -> int:
        """Shut down every connection still open; return how many were cut. Forgets them after."""
        with self._lock:
            fds, self._fds = self._fds, {}
        cut = 0
        for fd, link in fds.items():
            try:
                if os.readlink(f"{_FD_DIR}/{fd}") != link:
                    continue  # gloo closed it; the number now names another socket
                with socket.socket(fileno=os.dup(fd)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError:  # already closed or reset: nothing left to cut
                continue
        if cut:
            log.info("cut %d connection(s) of the old process group (%s)", cut, why)
        return cut


def scheduler_peers(host: str, port: int) -> set[tuple[str, int]]:
    """The addresses the scheduler's connections may show as their peer."""
    peers = {(host, port)}
    try:
        for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            peers.add((info[4][0], port))
    except OSError as exc:
        log.debug("cannot resolve %s: %s", host, exc)
    return peers
