"""Choosing the restore step: a pure function of what every rank says it holds.

Each rank reports
    {"step": s or None,   # the committed step its live state is at; None: a fresh process
     "disk": [step, ...], # complete disk checkpoints it can load
     "node": node_id}     # optional; echoed as the decision's "nodes" (rank -> node id)

With commit-or-skip a failed step changes nothing, so every live state is a correct committed
state, and live ranks are at most one step apart. The newest live step wins: ranks at it keep
their state ("self"); every other rank (one step behind, or a replacement) receives it from a
rank at it ("peer"; the holders share the sending). Nothing live is ever rolled back, and
survivors lose no step. When no rank holds a live state (a rerun, or every process was
restarted), the newest disk checkpoint every rank can load wins ("disk"); with none, the job
starts fresh ("init"). Ranks that lost their state while others hold disk checkpoints they
cannot all load are an error: starting over silently would lose the work.

`known_step` is the newest step the scheduler has seen the job commit (heartbeats, earlier
decisions). A restore from disk below it says how many steps are lost and redone (`from_step`), and a fresh
start while the job had committed steps is an error: every rank lost its live state and no
checkpoint holds it, so starting over would redo the work with a fresh schedule and end with other
weights, silently.
"""

from __future__ import annotations


def choose_restore(reports: dict[int, dict], known_step: int = 0) -> dict:
    decision = _choose(reports, known_step)
    nodes = {str(r): rep["node"] for r, rep in reports.items() if rep.get("node") is not None}
    if nodes:
        decision["nodes"] = nodes
    return decision


def _choose(reports: dict[int, dict], known_step: int = 0) -> dict:
    ranks = sorted(reports)
    live = {r: int(rep["step"]) for r, rep in reports.items() if rep.get("step") is not None}
    if live:
        s = max(live.values())
        holders = [r for r in ranks if live.get(r) == s]
        sources, turn = {}, 0
        for r in ranks:
            if r in holders:
                sources[str(r)] = {"kind": "self"}
            else:
                sources[str(r)] = {"kind": "peer", "peer": holders[turn % len(holders)]}
                turn += 1
        return {"step": s, "fresh": False, "from_step": s, "sources": sources}
    disk = {r: {int(s) for s in reports[r].get("disk", [])} for r in ranks}
    common = set.intersection(*disk.values()) if disk else set()
    if common:
        s = max(common)
        return {"step": s, "fresh": False, "from_step": max(s, known_step),
                "sources": {str(r): {"kind": "disk"} for r in ranks}}
    if not any(disk.values()) and known_step > 0:
        return {"step": None, "fresh": False, "from_step": known_step, "sources": {},
                "error": f"every rank lost its live state (the job had committed {known_step} steps) and no checkpoint "
                         "holds any step: starting over would silently redo them with a fresh schedule. Give the job "
                         "a checkpoint directory (TG_CHECKPOINT_DIR, or ModelCheckpoint) to resume from disk"}
    if not any(disk.values()):
        return {"step": 0, "fresh": True, "from_step": 0, "sources": {str(r): {"kind": "init"} for r in ranks}}
    have = "; ".join(f"rank {r}: disk {sorted(disk[r])}" for r in ranks)
    return {"step": None, "fresh": False, "from_step": None, "sources": {},
            "error": f"no step can be restored on every rank ({have}); keep at least 2 disk checkpoints "
                     "(keep_checkpoint_max >= 2) or restore the missing rank's files"}


def lost_steps(decision: dict) -> int:
    if decision.get("step") is None or decision.get("from_step") is None:
        return 0
    return max(0, int(decision["from_step"]) - int(decision["step"]))
