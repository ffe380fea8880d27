"""A worker stuck where no collective can end its wait prints every thread's stack, then ends as a dead worker.

Two ways to get there, both on the heartbeat thread, beside the stuck one:
- the scheduler judged it hung (control/waits.py) and says so in its heartbeat's reply (`die_hung`);
- `LeftBehind`: the cluster moved past this rank's generation, the group's connections were cut so that its
  collectives fail at once (sever.py), and yet a thread is still blocked in a collective of that generation
  `limit` seconds later. The cut missed a connection (one opened where trainguard did not see it), and the
  wait would last the backend's whole collective timeout (120 s by default) while the others regroup without
  it. No peer of that generation is left to complete it: every member leaves a generation the cluster left.

The stacks go to stderr, which `trainguard run` prefixes with the worker's name and keeps in its log. Then
SIGKILL: a thread stuck in C (a deadlocked loader, a filesystem that stopped answering, a socket nobody closes)
cannot be unwound, and the process is replaced as any dead worker is, back to the last commit.

`kill -USR2 <pid>` prints a worker's stacks the same way and changes nothing else (`dump_on_request`).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from typing import Callable

from .ledger import ledger

STACKS_SIGNAL = signal.SIGUSR2


def dump_on_request() -> None:
    """`kill -USR2` prints every thread's stack to stderr (faulthandler: it works while a thread is stuck in C)."""
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def print_stacks(why: str) -> None:
    """Every thread's stack to stderr, and nothing else (the scheduler asked: a formation waits for this worker)."""
    print(f"trainguard: {why}; its threads' stacks follow", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()


def die_hung(why: str) -> None:
    try:
        print_stacks(f"this worker is hung: {why}; it is killed and replaced")
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


def left_behind(now: float, news_at: float, blocked_since: float | None, limit: float) -> bool:
    """A thread has waited in a collective of a generation the cluster left for `limit` seconds since it learned
    (pure)."""
    return blocked_since is not None and now - max(news_at, blocked_since) >= limit


class LeftBehind:
    """Heartbeat thread, after each beat: `ours()` is this rank's generation, `seen()` the cluster's."""

    def __init__(self, ours: Callable[[], int], seen: Callable[[], int], limit: float):
        self.ours, self.seen, self.limit = ours, seen, limit
        self.news_at: float | None = None  # when this rank learned the cluster left its generation

    def check(self) -> None:
        gen, now = self.ours(), time.monotonic()
        if self.seen() <= gen or ledger.generation != gen:  # in step, or already building the next group
            self.news_at = None
            return
        if self.news_at is None:
            self.news_at = now
        if left_behind(now, self.news_at, ledger.blocked_since, self.limit):
            die_hung(f"a collective of generation {gen} still waits {now - self.news_at:.0f} s after the cluster "
                     f"moved on to generation {self.seen()} and its connections were cut (trainguard did not see "
                     "one of them open)")
