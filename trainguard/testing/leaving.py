"""Leaving a set of spawned gloo processes together (tests and benchmarks that make their own TCPStore)."""

from __future__ import annotations

import time


def leave_together(store, rank: int, world: int) -> None:
    """Return once every rank is done, the store's server (rank 0) last: nobody closes its gloo connections while a
    peer may still be in the last collective (gloo aborts a process whose peer closed mid-operation), and the
    server outlives every client's last request."""
    store.add("done", 1)
    while int(store.add("done", 0)) < world:
        time.sleep(0.01)
    store.add("gone", 1)
    while rank == 0 and int(store.add("gone", 0)) < world:
        time.sleep(0.01)
