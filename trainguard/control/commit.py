"""Group commit: every membership change made in one pass of the scheduler's event loop shares one save.

A handler that changes the cluster calls `changed()`; the save (one sqlite transaction, one fsync)
runs once, at the start of the loop's next pass, for everything changed in this one. No reply leaves
the scheduler before the changes it may reveal are durable: a connection (conn.py) sends each reply
only once `pending()`, the save due, has succeeded. So nothing acknowledged is lost when the scheduler
is killed, and a storm of 10,000 registrations costs a few hundred fsyncs instead of 10,000
(bench/scheduler_scale.py).

The save runs in the loop's thread: while it fsyncs, new requests wait in the kernel's buffers and
are handled together in the next pass, which is what makes the batches grow with the load.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable

log = logging.getLogger("trainguard.scheduler")


class GroupCommit:
    """`save(touched)` writes what changed: only among the node ids in `touched`, or among all of them
    when it is None (the meta row is always compared)."""

    def __init__(self, save: Callable[[set[str] | None], object]):
        self._save = save
        self._pending: asyncio.Future | None = None
        self._touched: set[str] | None = set()
        self._failed = False  # the last save failed: the next flush saves, whatever changed since
        self.commits = 0  # saves that ran

    def changed(self, node_ids: Iterable[str] | None = None) -> None:
        """Something durable changed, in those nodes' rows (None: maybe in any); save it at the start of
        the loop's next pass (once per pass)."""
        if node_ids is None:
            self._touched = None
        elif self._touched is not None:
            self._touched.update(node_ids)
        if self._pending is None:
            loop = asyncio.get_running_loop()
            self._pending = loop.create_future()
            self._pending.add_done_callback(_retrieve)
            loop.call_soon(self.flush)

    def flush(self) -> None:
        """Save now if anything changed, or a save failed; idempotent (the job's end calls it before closing)."""
        pending, self._pending = self._pending, None
        if pending is None and not self._failed:
            return
        touched, self._touched = self._touched, set()
        try:
            self._save(touched)
        except Exception as exc:  # a full disk, an I/O error: what waits on it must not be acknowledged
            log.error("cannot save the cluster state: %r; the replies that depend on it are not sent", exc)
            self._touched, self._failed = None, True  # the next save compares every row
            if pending is not None:
                pending.set_exception(exc)
            return
        self._failed = False
        self.commits += 1
        if pending is not None:
            pending.set_result(None)

    def pending(self) -> asyncio.Future | None:
        """The save every change made so far waits for, if one is due: its result is None, or the save's error.
        After a failed save one is always due (it is retried), so no reply goes out until the state is saved."""
        if self._failed and self._pending is None:
            self.changed(None)
        return self._pending


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # logged in flush; marks it retrieved when nobody waited on it
