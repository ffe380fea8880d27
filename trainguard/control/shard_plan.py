"""Choosing the restore step of a sharded job (FSDP, HSDP, DP x TP): a pure function of the reports.

Each rank reports
    {"step": s or None,          # the committed step its live state is at; None: a fresh process
     "shard": g,                 # which shard of the state it holds (ranks with the same g are replicas)
     "memory": {"g": [steps]},   # in-memory copies it holds: of its own shard, and its ward's (a buddy copy)
     "disk": [steps],            # complete disk checkpoints it can load
     "node": node_id}

A shard can be restored to step s from a live rank of that shard at s, or from an in-memory copy
of it at s anywhere. The job resumes at the newest step s that *every* shard can be restored to;
with none in memory, the newest disk checkpoint every rank can load; with no state anywhere, a
fresh start. A rank's source, in order of preference: its own live state ("self"), its own
in-memory copy ("memory"), a peer: a live replica first, then the rank holding a copy ("peer",
with "from": "live" or "memory"), and disk. The holders of a shard share the sending.

Unlike pure data parallelism, a live state may have to be rolled back: when a rank dies in the
last collective of step k+1, some shards' survivors are at k+1 and others at k, and no rank can
go back to k but from a copy. Survivors then lose the steps since the copy; the redone steps give
the same bits (same data, same seeds, the same group).
"""

from __future__ import annotations

from .restore_plan import choose_restore


def is_sharded(reports: dict[int, dict]) -> bool:
    return any("shard" in rep for rep in reports.values())


def choose_sharded_restore(reports: dict[int, dict]) -> dict:
    ranks = sorted(reports)
    shard = {r: int(reports[r]["shard"]) for r in ranks}
    live = {r: int(reports[r]["step"]) for r in ranks if reports[r].get("step") is not None}
    memory: dict[tuple[int, int], list[int]] = {}  # (shard, step) -> ranks holding a copy
    for r in ranks:
        for g, steps in (reports[r].get("memory") or {}).items():
            for s in steps:
                memory.setdefault((int(g), int(s)), []).append(r)
    shards = sorted(set(shard.values()))
    candidates = sorted({*live.values(), *(s for _, s in memory)}, reverse=True)
    for s in candidates:
        if all(any(live.get(r) == s and shard[r] == g for r in ranks) or (g, s) in memory for g in shards):
            return _sources(s, ranks, shard, live, memory, from_step=max(live.values(), default=s))
    decision = choose_restore({r: {"step": None, "disk": reports[r].get("disk", [])} for r in ranks})
    if live and decision.get("fresh"):  # nothing to resume from, but ranks hold work: never start over silently
        have = "; ".join(f"rank {r}: shard {shard[r]}, step {live.get(r)}" for r in ranks)
        decision = {"step": None, "fresh": False, "from_step": None, "sources": {},
                    "error": f"no step can be restored on every shard ({have}) and there is no disk checkpoint; "
                             "give the job a checkpoint directory, or keep a replica of every shard"}
    decision["from_step"] = max(live.values(), default=decision.get("from_step"))
    return decision


def _sources(s: int, ranks: list[int], shard: dict, live: dict, memory: dict, from_step: int) -> dict:
    sources, turn = {}, {}
    for r in ranks:
        g = shard[r]
        if live.get(r) == s:
            sources[str(r)] = {"kind": "self"}
            continue
        if r in memory.get((g, s), ()):
            sources[str(r)] = {"kind": "memory"}
            continue
        holders = [(q, "live") for q in ranks if shard[q] == g and live.get(q) == s] or \
                  [(q, "memory") for q in memory.get((g, s), ())]
        q, kind = holders[turn.get(g, 0) % len(holders)]
        turn[g] = turn.get(g, 0) + 1
        sources[str(r)] = {"kind": "peer", "peer": q, "from": kind}
    return {"step": s, "fresh": False, "from_step": from_step, "sources": sources}
