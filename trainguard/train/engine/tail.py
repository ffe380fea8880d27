"""The code after a step's update, before the next step: run again after a fault in it, or skipped?

A script's loop body often goes on after `optimizer.step()`: it logs a loss it all-reduces, evaluates every N
steps, saves its own checkpoint. A fault there (a peer dies during the eval's all_reduce) sends every rank back to
the step just committed. The script runs again from the top, and where its loop puts that code decides what
happens to it:

- at the top of the iteration (nanoGPT's eval), or after the epoch's batches (an epoch loop's eval): it runs again
  before the next step, and its output is the uninterrupted run's (a line may print twice);
- after `optimizer.step()` in the same iteration: the loop resumes at the next step, past it. The eval line of that
  step never prints, its checkpoint is never written, a metric it updates is never updated. Nothing else would say so.

So a surviving rank counts the collectives it entered after its last commit (the ledger's numbers). If a fault
ends that stretch, the count is kept across the rewind; when the script's next step begins, a rank that entered
fewer collectives since the restore than before the fault skipped some of that code, and the replay audit says so
(audit.py: a finding of kind "tail"). A tail without collectives (a print, rank 0's save with no barrier) is not
seen; trainguard's own collectives after the restore can hide a skip, never invent one.
"""

from __future__ import annotations

from ...worker.ledger import ledger
from .audit import Finding

_mark = 0  # the ledger's count at the last commit, or at the restore
_after = False  # between a commit (or the restore) and the next step's beginning
_left: tuple[int, int] | None = None  # (committed step, collectives entered after it) when a fault ended the stretch


def committed() -> None:
    """A step committed (or the job's state is in this run of the script): the stretch after it begins."""
    global _mark, _after
    _mark, _after = ledger.entered(), True


restored = committed


def left(step: int) -> None:
    """This run of the script is over (a rewind): what the stretch after `step`'s update had entered, if the fault
    came in it (not in a step: a step's own exchange is the step's)."""
    global _left
    ran = ledger.entered() - _mark
    _left = (step, ran) if _after and step and ran > 0 else None


def step_begins(step: int) -> Finding | None:
    """A step begins: after a restore to `step`, a finding if this rank skipped code that it ran after that step's
    update before the fault."""
    global _left, _after
    before, _left, _after = _left, None, False
    if before is None or before[0] != step:
        return None
    again = ledger.entered() - _mark
    return Finding(step, before[1], "tail", again) if again < before[1] else None
