"""Desyncs and hangs, decided from what the ranks say they wait in (pure functions, and the message they use).

Each rank numbers the collectives of each process group (worker/ledger.py). Its heartbeat says which one
it has been blocked in for a while (`Waiting`), and how long it has made no progress; a rank whose
collective failed says which one in its failure report. From those:

- **Desync**: two ranks of one generation at the same number of the same group with another operation
  or another shape (an `all_reduce` one rank makes and another does not, so that rank's next collective
  pairs with it; or a different tensor), or blocked at different numbers of the same group for longer
  than `settle` (one of them skipped a call, and its peers will wait for it until the backend's timeout),
  or blocked in the default group while a member has already finished its script. A desync is a bug in
  the script: the same code meets it again after any restart, so it is never healed as a fault.
- **Hang**: a rank has made no progress (no collective, no step, no batch) for `hang_timeout` seconds
  while another rank waits for it in a collective. It is taken for a fault: its stacks are printed and it
  is replaced.

What cannot be judged: two ranks that call different collectives whose sizes happen to match and that
the backend completes (the sums are silently wrong, and nobody waits); and, when only one rank
survives an abort, the dead rank's last call (it is not reported).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from .msgbase import Generation, Msg, Seq

Seconds = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]
Short = Annotated[str, Field(max_length=128, pattern=r"^[^\x00-\x1f\x7f]*$")]
Site = Annotated[str, Field(max_length=512, pattern=r"^[^\x00-\x1f\x7f]*$")]


class Waiting(Msg):
    """A collective a rank is blocked in (or that failed), as its heartbeat or failure report says."""

    generation: Generation
    group: Short  # torch's name of the group, "" for the default one
    seq: Seq  # its number among that group's collectives on this rank
    op: Short
    shape: Short  # the first tensor's dtype and shape; "" where ranks may pass other shapes
    site: Site  # file:line of the call in the script
    for_s: Seconds = 0.0  # blocked this long


END_OF_SCRIPT = "end of script"  # the op of a rank that ran its script to the end and waits to finish


@dataclass(frozen=True, slots=True)
class Desync:
    """What two ranks of `generation` disagree on, told as a user reads it."""

    ranks: tuple[int, int]
    text: str
    generation: int


def describe(rank: int, w: Waiting) -> str:
    if w.op == END_OF_SCRIPT:
        return f"rank {rank} has run its script to the end (after {w.seq - 1} collectives)"
    shape = f" of {w.shape}" if w.shape else ""
    group = f" on group {w.group}" if w.group else ""
    return f"rank {rank} is in {w.op}{shape} (collective #{w.seq}{group}) at {w.site}"


ADVICE = ("the ranks did not call the same collectives in the same order: a collective under a condition that "
          "differs by rank (an `if rank == 0:` around an all_reduce or barrier, a loop whose length differs by "
          "rank, an early `break`), or tensors of other shapes. Make every rank call each collective, with the "
          "same shapes")


def mismatch(points: dict[int, Waiting]) -> Desync | None:
    """Two ranks at the same collective number of the same group and generation with another operation or
    shape (failure reports and long waits alike)."""
    seen: dict[tuple[int, str, int], tuple[int, Waiting]] = {}
    for rank in sorted(points):
        w = points[rank]
        key = (w.generation, w.group, w.seq)
        if key not in seen:
            seen[key] = (rank, w)
            continue
        other, o = seen[key]
        if (o.op, o.shape) != (w.op, w.shape) and not (o.op == w.op and "" in (o.shape, w.shape)):
            return Desync((other, rank), f"{describe(other, o)}, but {describe(rank, w)}", w.generation)
    return None


def stuck_apart(waits: dict[int, Waiting], settle: float) -> Desync | None:
    """Two ranks blocked for `settle` seconds at different numbers of one group: one of them skipped a call."""
    firsts: dict[tuple[int, str], tuple[int, Waiting]] = {}
    for rank in sorted(waits):
        w = waits[rank]
        if w.for_s < settle:
            continue
        key = (w.generation, w.group)
        if key not in firsts:
            firsts[key] = (rank, w)
        elif firsts[key][1].seq != w.seq:
            other, o = firsts[key]
            return Desync((other, rank), f"{describe(other, o)}, but {describe(rank, w)}, both for over "
                                         f"{settle:g} s: one of them skipped a collective the other made",
                          w.generation)
    return None


def waits_for_finished(waits: dict[int, Waiting], finished: list[int], settle: float) -> Desync | None:
    """A rank blocked in the default group for `settle` seconds while another has ended its script."""
    for rank in sorted(waits):
        w = waits[rank]
        if w.group == "" and w.for_s >= settle and finished:
            return Desync((rank, finished[0]), f"{describe(rank, w)} for over {settle:g} s, but rank {finished[0]} "
                                               "has already finished its script: it never made that collective",
                          w.generation)
    return None


def find_desync(waits: dict[int, Waiting], finished: list[int], settle: float) -> Desync | None:
    """The first desync among the ranks' current waits (`finished`: the ranks that ended their script). Two waits
    at the same collective with other calls are one at once (no timing makes them legitimate); waits apart, or
    against an ended script, only after `settle` seconds (a rank a moment behind its peers is no desync)."""
    return mismatch(waits) or stuck_apart(waits, settle) or waits_for_finished(waits, finished, settle)


def find_hang(idle: dict[int, float], waits: dict[int, Waiting], hang_timeout: float | None,
              settle: float) -> tuple[int, float] | None:
    """(rank, seconds) of a rank without progress for `hang_timeout` while another waits in a collective."""
    if not hang_timeout or not any(w.for_s >= settle for w in waits.values()):
        return None
    stuck = [(s, r) for r, s in idle.items() if r not in waits and s >= hang_timeout]
    if not stuck:
        return None
    seconds, rank = max(stuck)
    return rank, seconds


def rewind_first(generation: int, step: int, repaired_at: int | None) -> bool:
    """A desync in a generation formed after a recovery (the ranks may have come back disagreeing) is met with one
    rewind of every rank per step; one in the job's first generation, or again at the same step, ends the job."""
    return generation > 1 and repaired_at != step
