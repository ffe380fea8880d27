"""Decisions the scheduler takes once every rank has reported (see Agree in protocol.py)."""

from __future__ import annotations

from .reports import ErrorReport, FinishReport, RestoreReport
from .restore_plan import choose_restore
from .shard_plan import choose_sharded_restore, is_sharded


def decide_agreement(purpose: str, reports: dict[int, RestoreReport | FinishReport | ErrorReport],
                     known_step: int = 0) -> dict:
    """`reports`: rank -> its report, of the purpose's own model (protocol.Agree checks it).
    `known_step`: the newest step the job is known to have committed (restore_plan.py)."""
    if purpose == "restore":
        plain = {r: rep.as_plan_input() for r, rep in reports.items()}
        return choose_sharded_restore(plain) if is_sharded(plain) else choose_restore(plain, known_step)
    if purpose == "error":  # every rank raised: the same error at the same step is deterministic
        found = {(r.signature, r.step) for r in reports.values()}
        return {"same": len(found) == 1, "signatures": sorted(s for s, _ in found)[:8]}
    if purpose == "finish":
        steps = {r.step for r in reports.values()}
        return {"ok": len(steps) == 1, "steps": sorted(steps)}
    raise AssertionError(purpose)
