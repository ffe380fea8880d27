"""Choosing the restore step: a pure function of what every rank says it holds.

Each rank reports a RestoreReport (reports.py): the committed step its live state is at (None: a fresh
process) and the complete disk checkpoints it can load. The decision is a RestoreDecision (outcomes.py).

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

from .outcomes import RestoreDecision, Source, SourceKind, failed_restore
from .reports import RestoreReport


def choose_restore(reports: dict[int, RestoreReport], known_step: int = 0) -> RestoreDecision:
    """`reports`: rank -> its report, for ranks 0..n-1."""
    ranks = sorted(reports)
    live = {r: reports[r].step for r in ranks if reports[r].step is not None}
    if live:
        s = max(live.values())
        holders = [r for r in ranks if live.get(r) == s]
        sources, turn = [], 0
        for r in ranks:
            if r in holders:
                sources.append(Source(kind=SourceKind.SELF))
            else:
                sources.append(Source(kind=SourceKind.PEER, peer=holders[turn % len(holders)]))
                turn += 1
        return RestoreDecision(step=s, from_step=s, sources=sources)
    return choose_from_disk({r: reports[r].disk for r in ranks}, known_step)


def choose_from_disk(disk_steps: dict[int, list[int]], known_step: int = 0) -> RestoreDecision:
    """No rank holds a live state: the newest disk checkpoint every rank can load, else a fresh start."""
    ranks = sorted(disk_steps)
    disk = {r: set(disk_steps[r]) for r in ranks}
    common = set.intersection(*disk.values()) if disk else set()
    if common:
        s = max(common)
        return RestoreDecision(step=s, from_step=max(s, known_step),
                               sources=[Source(kind=SourceKind.DISK) for _ in ranks])
    if not any(disk.values()) and known_step > 0:
        return failed_restore(
            f"every rank lost its live state (the job had committed {known_step} steps) and no checkpoint "
            "holds any step: starting over would silently redo them with a fresh schedule. Give the job "
            "a checkpoint directory (TG_CHECKPOINT_DIR, or ModelCheckpoint) to resume from disk; to start over "
            "(or from the script's own checkpoint), run it with a new --recovery-path", known_step)
    if not any(disk.values()):
        return RestoreDecision(step=0, fresh=True, from_step=0, sources=[Source(kind=SourceKind.INIT) for _ in ranks])
    have = "; ".join(f"rank {r}: disk {sorted(disk[r])}" for r in ranks)
    return failed_restore(f"no step can be restored on every rank ({have}); keep at least 2 disk checkpoints "
                          "(keep_checkpoint_max >= 2) or restore the missing rank's files", None)
