"""A dropped generation's process groups are let go on a thread of their own, never where the script runs.

gloo's ProcessGroup destructor waits for the work still pending in it, and work blocked with a peer that is
alive, on a connection the cut did not reach (sever.py), waits the whole collective timeout: measured with torch
2.13, two ranks, an all_reduce one rank never joined, the last `del` of the group took 19.1 s under a 20 s
timeout (120 s is trainguard's default). The last reference to a dropped group often goes in the main thread,
as the script's previous run is let go (its model held the group) right before it runs again and joins the next
generation: that wait would hold back the regroup of every rank.

So the runtime hands each generation's groups here when it drops them. They are held until the next generation
is dropped (by then the script's previous run is long gone, so this is the last reference), and are then let
go by a daemon thread. The destructor releases the GIL while it waits (measured: the main thread ran on), so
that thread costs the training nothing; a process that ends meanwhile does not wait for it.
"""

from __future__ import annotations

import threading

_held: list = []  # the last dropped generation's groups


def bury(groups: list) -> None:
    """Hold `groups` (a generation just dropped); let the ones held before go, on a thread of their own."""
    global _held
    old, _held = _held, [g for g in groups if g is not None]
    if old:
        threading.Thread(target=old.clear, name="trainguard-reaper", daemon=True).start()
