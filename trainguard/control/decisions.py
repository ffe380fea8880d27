"""Decisions the scheduler takes once every rank has reported (see Agree in protocol.py)."""

from __future__ import annotations

from .outcomes import (
    Decided,
    ErrorDecision,
    FinishDecision,
    RestoreDecision,
    failed_restore,
)
from .reports import ErrorReport, Report, RestoreReport, ShardedRestoreReport
from .restore_plan import choose_restore
from .shard_plan import choose_sharded_restore


def decide_agreement(purpose: str, reports: dict[int, Report], known_step: int = 0) -> Decided:
    """`reports`: rank -> its report, of the purpose's own model (protocol.Agree checks it).
    `known_step`: the newest step the job is known to have committed (restore_plan.py)."""
    if purpose == "restore":
        return decide_restore(reports, known_step)  # type: ignore[arg-type]
    if purpose == "error":
        found = {(r.signature, r.step) for r in reports.values()}  # type: ignore[union-attr]
        return ErrorDecision(same=len(found) == 1, signatures=sorted(s for s, _ in found)[:8],
                             reason="every rank raised it at the same step")
    if purpose == "finish":
        steps = {r.step for r in reports.values()}
        return FinishDecision(ok=len(steps) == 1, steps=sorted(steps))
    raise AssertionError(purpose)


def raised_again(raised: dict[tuple[str, int], tuple[int, int]], report: ErrorReport, rank: int,
                 generation: int) -> ErrorDecision | None:
    """A rank's script raised `report`'s error in `generation`. `raised`: (signature, step) -> (rank, generation) of
    its first raise in the job. The same error at the same step in a later generation, after the job recovered and
    resumed there, is deterministic: a bug that the resumed run reaches (a variable set only inside the loop, read
    after it when a resume leaves the loop nothing to do). The first time, raised by one rank alone (the others wait
    in a collective, so the vote on it cannot complete), it is a fault, recovered as any other. Pure."""
    earlier = raised.get((report.signature, report.step))
    if earlier is None or earlier[1] >= generation:
        return None
    who = "it" if earlier[0] == rank else f"rank {earlier[0]}"
    return ErrorDecision(same=True, signatures=[report.signature], reason=(
        f"rank {rank} raised it again at step {report.step}, where {who} raised it before the job recovered and "
        "resumed there"))


def decide_restore(reports: dict[int, RestoreReport], known_step: int = 0) -> RestoreDecision:
    sharded = [isinstance(rep, ShardedRestoreReport) for rep in reports.values()]
    if all(sharded):
        return choose_sharded_restore(reports, known_step)  # type: ignore[arg-type]
    if not any(sharded):
        return choose_restore(reports, known_step)
    mixed = sorted(r for r, rep in reports.items() if isinstance(rep, ShardedRestoreReport))
    return failed_restore(f"ranks {mixed} report a sharded state and the others a replicated one: every rank of a job "
                          "must train the same layout (run every rank from the same script and version)", known_step)
