"""Where this rank is in its sequence of collectives, and when it last made progress.

The typed wrappers (collectives.py) see every collective a script or a library makes through
torch.distributed. Each one gets a number in its process group: the n-th call on group G is
`(G, n)`, the same call on every member of G as long as the ranks run the same code. The ledger
keeps, at a cost of about a microsecond a call:

- `seq`: per group, the number of the last collective entered;
- `waiting`: the collective a thread of this rank is blocked in (a synchronous call, or the `wait()`
  of an asynchronous one), with when it began;
- `failed`: the collective that raised, the last time one did;
- `blocked_since`: when a thread began to wait in any collective, point-to-point ones included (hang.py's
  LeftBehind: one still blocked long after the cluster left its generation was not cut loose);
- `progress`: when this rank last did something the job can see (a collective entered or done, a
  step begun or committed, a training batch).

The heartbeat thread reads it (`report`): the scheduler compares what the ranks wait in (a desync:
control/waits.py) and how long each has made no progress (a hang). The call site (file:line in the
script) is taken only then, from the blocked thread's frames, so the hot path never walks a stack.

Point-to-point calls (send, recv) are only progress: the ranks of a group do not all make them, so
they have no place in the group's sequence. A group is named by its torch name ("" for the
default group); the counters start again with each generation's group. They are comparable across ranks
only where every rank's script starts from the top in each generation (under `trainguard run`, a fault
rewinds every rank), or in a job's first generation: a rank recovered in place by hand resumes mid-script
while its replacement starts at the top, so after a recovery there it reports no collective, only idleness.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass

import torch

from .. import rewinding
from ..control.waits import END_OF_SCRIPT, Waiting

POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv"})
UNEVEN = frozenset({"all_to_all", "all_to_all_single", "all_gather_object", "gather_object", "scatter_object_list",
                    "broadcast_object_list", "gather", "scatter"})  # shapes may differ by rank: only the op counts
_CONTROL = {c: "?" for c in (*range(32), 0x7F)}
OURS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # trainguard's and torch's code: a
        os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)  # frame elsewhere is the script's (or its library's)


@dataclass(frozen=True, slots=True)
class Point:
    """One collective of one group: its number there, the operation, and its first tensor's dtype and shape."""

    group: str
    seq: int
    op: str
    shape: str


def signature(op: str, args: tuple, kwargs: dict) -> str:
    """The first tensor argument's dtype and shape ("float32[4, 8]"), a list's length and first shape; ""
    where ranks may legitimately pass other shapes."""
    if op in UNEVEN:
        return ""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}"
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return f"{len(a)}x{str(a[0].dtype).removeprefix('torch.')}{list(a[0].shape)}"
    return ""


def group_name(group) -> str:
    """The group's torch name, the same on every member; "" for the default group."""
    if group is None:
        return ""
    try:
        from torch.distributed import distributed_c10d as c10d

        if group is c10d.GroupMember.WORLD:
            return ""
        return str(group.group_name)
    except (AttributeError, RuntimeError, ValueError):
        return "?"


def call_site(frame) -> str:
    """file:line of the innermost frame outside torch and trainguard (the script's, or its library's)."""
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(OURS) and not name.startswith("<frozen"):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class Ledger:
    def __init__(self) -> None:
        self.seq: dict[str, int] = {}
        self.generation = 0
        self.comparable = True  # the numbers mean the same on every rank (see the module docstring)
        self.waiting: Point | None = None
        self.since = 0.0
        self.thread = 0  # the ident of the thread that waits
        self.failed: Point | None = None
        self.failed_site = ""
        self.progress = time.monotonic()
        self.blocked_since: float | None = None  # a thread blocked in any collective, point-to-point ones too

    def reset(self, generation: int) -> None:
        """A new generation's group: every sequence starts again."""
        self.seq, self.generation, self.waiting, self.failed, self.failed_site = {}, generation, None, None, ""
        self.blocked_since = None
        self.progress = time.monotonic()
        self.comparable = rewinding.available() or generation == 1

    def enter(self, op: str, group, args: tuple, kwargs: dict) -> Point | None:
        """A collective begins; its point (None for point-to-point)."""
        self.progress = time.monotonic()
        if op in POINT_TO_POINT:
            return None
        name = group_name(group)
        n = self.seq.get(name, 0) + 1
        self.seq[name] = n
        return Point(name, n, op, signature(op, args, kwargs))

    def entered(self) -> int:
        """Collectives entered in this generation, every group's (point-to-point calls not counted)."""
        return sum(self.seq.values())

    def at_end(self) -> Point:
        """The script ran to its end (it waits for the others to finish): a point after its last collective."""
        return Point("", self.seq.get("", 0) + 1, END_OF_SCRIPT, "")

    def wait(self, point: Point | None) -> None:
        """This thread blocks until `point` completes (None: a point-to-point call, only timed)."""
        self.blocked_since = now = time.monotonic()
        if point is not None:
            self.waiting, self.since, self.thread = point, now, threading.get_ident()

    def done(self, point: Point | None) -> None:
        self.progress = time.monotonic()
        self.blocked_since = None
        if self.waiting is point:
            self.waiting = None

    def fail(self, point: Point | None) -> None:
        """`point` raised: kept for the failure report, with the script's line."""
        if point is not None and self.failed is None:
            self.failed, self.failed_site = point, call_site(sys._getframe(2))
        self.blocked_since = None
        if self.waiting is point:
            self.waiting = None

    def progressed(self) -> None:
        self.progress = time.monotonic()

    def report(self, at_least: float) -> tuple[Point | None, float, str, float]:
        """(point, seconds in it, call site, seconds since the last progress): the point only once this rank
        has waited in it `at_least` seconds."""
        now = time.monotonic()
        point, since, thread = self.waiting, self.since, self.thread
        idle = now - self.progress
        if point is None or now - since < at_least:
            return None, 0.0, "", idle
        frame = sys._current_frames().get(thread)
        site = call_site(frame) if frame is not None else "?"
        if self.waiting is not point:  # it completed meanwhile
            return None, 0.0, "", idle
        return point, now - since, site, 0.0


ledger = Ledger()


def _clean(text: str, limit: int) -> str:
    """Text for a message field: no control characters, the last `limit` characters."""
    return text.translate(_CONTROL)[-limit:]


def as_waiting(point: Point, generation: int, site: str, for_s: float = 0.0) -> Waiting:
    return Waiting(generation=generation, group=_clean(point.group, 128), seq=point.seq, op=_clean(point.op, 128),
                   shape=_clean(point.shape, 128), site=_clean(site, 512), for_s=max(0.0, for_s))


def beat(at_least: float) -> tuple[Waiting | None, float]:
    """What a heartbeat says: the collective this rank has waited in for `at_least` seconds, and its idle time."""
    point, for_s, site, idle = ledger.report(at_least)
    shown = point is not None and ledger.comparable
    return (as_waiting(point, ledger.generation, site, for_s) if shown else None), max(0.0, idle)


def failed_at() -> Waiting | None:
    """The collective that failed in this generation, for the failure report."""
    point = ledger.failed
    return as_waiting(point, ledger.generation, ledger.failed_site) if point is not None and ledger.comparable else None
