"""Choosing the restore step of a sharded job (FSDP, HSDP, DP x TP): a pure function of the reports.

Each rank reports a ShardedRestoreReport (reports.py): the committed step its live state is at (None: a
fresh process), which shard of the state it holds (ranks with the same shard are replicas), the in-memory
copies it holds (of its own shard, and its ward's: a buddy copy) and the disk checkpoints it can load.

A shard can be restored to step s from a live rank of that shard at s, or from an in-memory copy
of it at s anywhere. The job resumes at the newest step s that *every* shard can be restored to;
with none in memory, the newest disk checkpoint every rank can load; with no state anywhere, a
fresh start. A rank's source (outcomes.SourceKind), in order of preference: its own live state,
its own in-memory copy, a peer: a live replica first, then the rank holding a copy (CopyKind), and disk. The holders of a shard share the sending.

Unlike pure data parallelism, a live state may have to be rolled back: when a rank dies in the
last collective of step k+1, some shards' survivors are at k+1 and others at k, and no rank can
go back to k but from a copy. Survivors then lose the steps since the copy; the redone steps give
the same bits (same data, same seeds, the same group).
"""

from __future__ import annotations

from .outcomes import CopyKind, RestoreDecision, Source, SourceKind, failed_restore
from .reports import ShardedRestoreReport
from .restore_plan import choose_from_disk


def choose_sharded_restore(reports: dict[int, ShardedRestoreReport], known_step: int = 0) -> RestoreDecision:
    """`reports`: rank -> its report, for ranks 0..n-1. `known_step`: the newest step the scheduler has seen the
    job commit: with every live state and copy gone and no checkpoint, a fresh start would silently redo it."""
    ranks = sorted(reports)
    shard = {r: reports[r].shard for r in ranks}
    live = {r: reports[r].step for r in ranks if reports[r].step is not None}
    memory: dict[tuple[int, int], list[int]] = {}  # (shard, step) -> ranks holding a copy
    for r in ranks:
        for g, steps in reports[r].memory.items():
            for s in steps:
                memory.setdefault((int(g), s), []).append(r)
    shards = sorted(set(shard.values()))
    candidates = sorted({*live.values(), *(s for _, s in memory)}, reverse=True)
    for s in candidates:
        if all(any(live.get(r) == s and shard[r] == g for r in ranks) or (g, s) in memory for g in shards):
            return RestoreDecision(step=s, from_step=max(live.values(), default=s),
                                   sources=_sources(s, ranks, shard, live, memory))
    from_step = max(live.values(), default=None)
    disks = {r: reports[r].disk for r in ranks}
    decision = choose_from_disk(disks, known_step)
    if live and not any(disks.values()):  # nothing to resume from, but ranks hold work: never start over silently
        have = "; ".join(f"rank {r}: shard {shard[r]}, step {live.get(r)}" for r in ranks)
        return failed_restore(f"no step can be restored on every shard ({have}) and there is no disk checkpoint; "
                              "give the job a checkpoint directory, or keep a replica of every shard", from_step)
    return decision.model_copy(update={"from_step": decision.from_step if from_step is None else from_step})


def _sources(s: int, ranks: list[int], shard: dict, live: dict, memory: dict) -> list[Source]:
    sources, turn = [], {}
    for r in ranks:
        g = shard[r]
        if live.get(r) == s:
            sources.append(Source(kind=SourceKind.SELF))
            continue
        if r in memory.get((g, s), ()):
            sources.append(Source(kind=SourceKind.MEMORY))
            continue
        holders = [(q, CopyKind.LIVE) for q in ranks if shard[q] == g and live.get(q) == s] or \
                  [(q, CopyKind.MEMORY) for q in memory.get((g, s), ())]
        q, origin = holders[turn.get(g, 0) % len(holders)]
        turn[g] = turn.get(g, 0) + 1
        sources.append(Source(kind=SourceKind.PEER, peer=q, origin=origin))
    return sources
