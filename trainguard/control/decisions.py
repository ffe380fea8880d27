"""Decisions the scheduler takes once every rank has reported (see Agree in protocol.py)."""

from __future__ import annotations

from .restore_plan import choose_restore
from .shard_plan import choose_sharded_restore, is_sharded


def decide_agreement(purpose: str, reports: dict[int, dict], known_step: int = 0) -> dict:
    """`known_step`: the newest step the job is known to have committed (restore_plan.py)."""
    if purpose == "restore":
        return choose_sharded_restore(reports) if is_sharded(reports) else choose_restore(reports, known_step)
    if purpose == "error":  # every rank raised: the same error at the same step is deterministic
        found = {(str(r.get("signature", "")), r.get("step")) for r in reports.values()}
        return {"same": len(found) == 1, "signatures": sorted(s for s, _ in found)[:8]}
    if purpose == "finish":
        steps = {int(r.get("step", -1)) for r in reports.values()}
        return {"ok": len(steps) == 1, "steps": sorted(steps)}
    raise AssertionError(purpose)
