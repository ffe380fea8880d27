"""Choosing the restore step: a pure function of what every rank says it can restore.

Each rank reports
    {"memory": [[step, replicated], ...],   # in-memory snapshots it holds; `replicated` means it
                                            # also holds every rank's per-rank state for that step
     "disk":   [step, ...],                 # complete disk checkpoints of its own
     "node":   node_id}                     # optional; echoed as the decision's "nodes" (rank -> node id),
                                            # so that state can follow a node whose rank moved (elastic)

The newest step s wins such that every rank r can get its state at s from
    itself (s in its memory), else a peer p (s in p's memory and replicated), else its disk.
If no rank holds anything, the job starts fresh. If ranks hold state but no step is
restorable everywhere, that is an error: starting over silently would lose the work.
"""

from __future__ import annotations


def choose_restore(reports: dict[int, dict]) -> dict:
    decision = _choose(reports)
    nodes = {str(r): rep["node"] for r, rep in reports.items() if rep.get("node") is not None}
    if nodes:
        decision["nodes"] = nodes
    return decision


def _choose(reports: dict[int, dict]) -> dict:
    memory = {r: {int(s): bool(rep) for s, rep in rep_.get("memory", [])} for r, rep_ in reports.items()}
    disk = {r: {int(s) for s in rep_.get("disk", [])} for r, rep_ in reports.items()}
    ranks = sorted(reports)
    held = [s for r in ranks for s in memory[r]]
    from_step = max(held) if held else None
    candidates = sorted({s for r in ranks for s in memory[r]} | {s for r in ranks for s in disk[r]}, reverse=True)
    if not candidates:
        return {"step": 0, "fresh": True, "from_step": 0, "sources": {str(r): {"kind": "init"} for r in ranks}}
    for s in candidates:
        sources: dict[str, dict] = {}
        for r in ranks:
            if s in memory[r]:
                sources[str(r)] = {"kind": "self"}
                continue
            peers = [p for p in ranks if memory[p].get(s)]
            if peers:
                sources[str(r)] = {"kind": "peer", "peer": peers[0]}
            elif s in disk[r]:
                sources[str(r)] = {"kind": "disk"}
            else:
                break
        else:
            return {"step": s, "fresh": False, "from_step": from_step if from_step is not None else s,
                    "sources": sources}
    have = "; ".join(f"rank {r}: memory {sorted(memory[r])}, disk {sorted(disk[r])}" for r in ranks)
    return {"step": None, "fresh": False, "from_step": from_step, "sources": {},
            "error": f"no step can be restored on every rank ({have}); keep at least 2 disk checkpoints "
                     "(keep_checkpoint_max >= 2) or restore the missing rank's files"}


def lost_steps(decision: dict) -> int:
    if decision.get("step") is None or decision.get("from_step") is None:
        return 0
    return max(0, int(decision["from_step"]) - int(decision["step"]))
