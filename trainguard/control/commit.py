"""Group commit: every membership change made in one pass of the scheduler's event loop shares one save.

A handler that changes the cluster calls `changed()`; the save (one sqlite transaction, one fsync)
runs once, at the start of the loop's next pass, for everything changed in this one. No reply leaves
the scheduler before the changes it may reveal are durable: `_handle` hands each reply to `send()`,
which writes it at once when nothing waits to be saved, and otherwise right after the save, in the
order the replies were given. So nothing acknowledged is lost when the scheduler is killed, and a storm
of 10,000 registrations costs a few hundred fsyncs instead of 10,000 (bench/scheduler_scale.py).

A reply that waits does not hold its connection's task: the task goes back to reading at once, and the
save writes the waiting replies itself. In a registration storm nearly every pass has a save, and a task
suspended and resumed for each request's reply was a large part of the scheduler's CPU.

The save runs in the loop's thread: while it fsyncs, new requests wait in the kernel's buffers and
are handled together in the next pass, which is what makes the batches grow with the load.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable, Protocol

log = logging.getLogger("trainguard.scheduler")


class ReplyStream(Protocol):
    """Where a reply goes: an asyncio StreamWriter, or the TLS session over one (tlsstream.py)."""

    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class GroupCommit:
    """`save(touched)` writes what changed: only among the node ids in `touched`, or among all of them
    when it is None (the meta row is always compared)."""

    def __init__(self, save: Callable[[set[str] | None], object]):
        self._save = save
        self._scheduled = False  # a save runs at the start of the loop's next pass
        self._touched: set[str] | None = set()
        self._failed = False  # the last save failed: the next flush saves, whatever changed since
        self._waiting: list[tuple[ReplyStream, bytes]] = []  # replies held until the save
        self._settled: asyncio.Future | None = None  # for a closing connection: the held replies are out
        self.commits = 0  # saves that ran

    def changed(self, node_ids: Iterable[str] | None = None) -> None:
        """Something durable changed, in those nodes' rows (None: maybe in any); save it at the start of
        the loop's next pass (once per pass)."""
        if node_ids is None:
            self._touched = None
        elif self._touched is not None:
            self._touched.update(node_ids)
        self._schedule()

    def send(self, stream: ReplyStream, data: bytes) -> bool:
        """Write `data` once every change made so far is saved: now, when nothing waits to be saved (True:
        the caller may await the stream's drain), or right after the save (False). While a failed save has
        not been redone, every reply waits for the retry; if a save fails, its waiting streams are closed
        instead, and no reply that may reveal an unsaved change leaves."""
        if not (self._scheduled or self._failed):
            stream.write(data)
            return True
        self._waiting.append((stream, data))
        self._schedule()
        return False

    async def settled(self) -> None:
        """Return once the replies held now are written (or dropped by a failed save): a connection that
        ends waits for this before it closes, so a reply held for the save still reaches its peer."""
        if self._waiting:
            if self._settled is None:
                self._settled = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._settled)

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Save now if anything changed, or a save failed; then send or drop the replies that waited.
        Idempotent (the job's end calls it before closing)."""
        scheduled, self._scheduled = self._scheduled, False
        waiting, self._waiting = self._waiting, []
        settled, self._settled = self._settled, None
        try:
            self._commit(scheduled, waiting)
        finally:
            if settled is not None:
                settled.set_result(None)

    def _commit(self, scheduled: bool, waiting: list[tuple[ReplyStream, bytes]]) -> None:
        if scheduled or self._failed:
            touched, self._touched = self._touched, set()
            try:
                self._save(touched)
            except Exception as exc:  # a full disk, an I/O error: what waits on it must not be acknowledged
                log.error("cannot save the cluster state: %r; the %d replies that depend on it are not sent "
                          "(their connections are closed)", exc, len(waiting))
                self._touched, self._failed = None, True  # the next save compares every row
                for stream, _ in waiting:
                    stream.close()
                return
            self._failed = False
            self.commits += 1
        for stream, data in waiting:
            try:
                stream.write(data)
            except (ConnectionError, OSError, RuntimeError) as exc:  # that peer is gone; the others still get theirs
                log.debug("a reply held for the save was not sent: %r", exc)
