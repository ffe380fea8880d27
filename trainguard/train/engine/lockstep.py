"""Every rank's committed step rides in the gradient exchange beside its stop vote, so ranks that part are told.

A script that decides on one rank's own value whether to update (`if loss.item() > limit: continue` after the
backward, a NaN check on the local loss, a condition on rank 0 alone) calls `optimizer.step()` on some ranks and not
on others. The gradient exchanges still pair one to one (every rank ran its backward), so nothing hangs and nothing
fails: under torch's DDP the replicas part in silence, and a recovery would then restore every rank from one of
them. Here each rank's slot of the exchange's control slots (train/parallel/gradsync.py) holds its stop vote and its
committed step (modulo `CYCLE`), and the update after an exchange whose steps differ is refused: the job ends with
the desync verdict (exit 79), naming the ranks and the fix.

A slot's sum is one rank's value plus zeros: exact for integers below 2**24 in a float32 bucket, which
`SIGNALS * CYCLE` stays under. Pure functions but `check`.
"""

from __future__ import annotations

import sys

from ...control import protocol as p
from ...exitcodes import EXIT_DESYNC
from .graceful import stop_on_fault

SIGNALS = 64  # stop votes are signal numbers (or 0), below this
CYCLE = 1 << 17  # committed steps travel modulo this: SIGNALS * CYCLE = 2**23


def control(signum: int, step: int) -> int:
    """This rank's control value: its stop vote and its committed step."""
    return signum + SIGNALS * (step % CYCLE)


def stop_vote(controls: list[int]) -> int:
    """The job's stop vote out of every rank's control value: the highest signal number, or 0."""
    return max(c % SIGNALS for c in controls)


def parted(controls: list[int]) -> str | None:
    """What is wrong where the ranks' committed steps in one exchange differ, else None."""
    steps = [c // SIGNALS for c in controls]
    if len(set(steps)) <= 1:
        return None
    ahead = max(steps)
    return (f"the ranks' updates parted: rank(s) {[r for r, s in enumerate(steps) if s != ahead]} had made fewer "
            f"optimizer steps than rank(s) {[r for r, s in enumerate(steps) if s == ahead]} when their gradients were "
            f"exchanged (committed steps {steps}, modulo {CYCLE}), so their models differ. Either the script called "
            "optimizer.step() after a backward on some ranks and not on others, a decision on one rank's own value "
            "(`if loss.item() > limit: continue`, a NaN check of the local loss, a condition on rank 0 alone): decide "
            "from a value every rank shares (the exchanged gradients' norm from clip_grad_norm_, a loss all_reduce'd "
            "first), or step on every rank. Or its ranks started at other steps (start_step(n) with a resume point "
            "only some ranks loaded): load it on every rank")


def check(session, controls: list[int]) -> None:
    """Right before an update: where the exchange's steps differ, the job ends with the desync verdict (the scheduler
    ends it for every rank; this rank saves the committed state's dying gasp as a desync's verdict does)."""
    text = parted(controls)
    if text is None:
        return
    rt = session.rt
    rt.events.emit("desync", ranks=[rt.rank], detail=f"desync: {text}"[-1000:], generation=rt.generation,
                   step=session.step, action="end", seen_in="the gradient exchange")
    print(f"trainguard: rank {rt.rank}: {text}", file=sys.stderr, flush=True)
    rt.report_failure(text, kind=p.FailureKind.DESYNC)
    stop_on_fault(session, text, verdict=EXIT_DESYNC)
