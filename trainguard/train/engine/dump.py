"""Dying-gasp checkpoints: what a leaving rank writes, and writing it before a deadline.

A graceful exit writes the one step every rank agreed on. A dump (the dump recover strategy)
happens after a fault, without agreement: each survivor writes its committed state, and the
lowest surviving rank also writes each dead rank's part: in data parallelism every rank's part
is the same (shared state, and progress; random streams are re-seeded from the step). Survivors
can be one step apart (an all-reduce completed on some ranks only); then their checkpoints hold
different steps and the next run resumes from the newest step every rank has on disk, which may
be an older regular checkpoint. What cannot be written is said, never papered over.
Each rank's state is its part of the checkpoint's shared folder; whoever writes rank 0's part
waits for the others and completes it (checkpoint/jobsave.py).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ...errors import CheckpointError, TrainguardError

log = logging.getLogger("trainguard.dump")

GASP_THREAD = "trainguard-dying-gasp"  # the writer's thread name (testing.faults slows only this one)


# --- what to write (pure) ---------------------------------------------------------------


def plan_dump(held: dict[int, frozenset[int]], me: int, dead: frozenset[int] | None,
              writes_for_dead: bool) -> tuple[list[tuple[int, int]], list[str]]:
    """(step, rank) pairs a survivor writes, oldest first, and notes on what it cannot write.

    held: step -> the ranks whose own state this survivor holds at that step (itself at least).
    dead: the ranks the scheduler says died (None: unknown). writes_for_dead: this survivor is the
    lowest alive rank, so it writes the dead ranks' states too."""
    plan = [(s, me) for s in sorted(held)]
    notes: list[str] = []
    if dead is None:
        notes.append("could not learn from the scheduler which ranks died; only this rank's own state is saved")
        return plan, notes
    if not writes_for_dead:
        return plan, notes
    for q in sorted(dead - {me}):
        have = [s for s in sorted(held) if q in held[s]]
        plan += [(s, q) for s in have]
        if have:
            notes.append(f"rank {q} died; its state at step {', '.join(map(str, have))} is written from the "
                         f"replicas held by rank {me}")
        else:
            notes.append(f"rank {q} died and no snapshot here holds its own state (RNG, data position); only "
                         "the surviving ranks' states are written, and a rerun resumes from the newest step "
                         "that every rank has on disk")
    return plan, notes


def who_died(status: dict, me: int) -> tuple[frozenset[int], bool]:
    """From the scheduler's status: the dead ranks, and whether `me` is the lowest alive rank."""
    nodes = [n for n in status.get("nodes", []) if int(n.get("rank", -1)) >= 0]
    dead = frozenset(int(n["rank"]) for n in nodes if n["state"] == "dead")
    alive = [int(n["rank"]) for n in nodes if n["state"] in ("alive", "unknown")] + [me]
    return dead, me == min(alive)


def dump_targets(snap, rt, *, patience: float) -> tuple[list[tuple], list[str]]:
    """[(snapshot, rank, own blob)] this survivor writes, and notes on what it cannot. `snap` is its
    committed state; in data parallelism every rank's part of it is the same, so it can stand in
    for any dead rank's."""
    held = {snap.step: frozenset(snap.ranks or {rt.rank})}
    dead, writer = None, False
    deadline = time.monotonic() + patience
    try:
        while True:  # a death may reach the scheduler a moment after our collective failed
            dead, writer = who_died(rt.client.status(patience=patience), rt.rank)
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
    except (TrainguardError, OSError) as exc:
        log.warning("dump: no status from the scheduler: %s", exc)
    plan, notes = plan_dump(held, rt.rank, dead, writer)
    items = [(snap, r, snap.own if r == rt.rank else snap.ranks[r]) for _, r in plan]
    return items, notes


# --- writing before a deadline ------------------------------------------------------------


@dataclass
class DumpResult:
    grace: float
    saved: list[tuple[int, int, str]] = field(default_factory=list)  # (rank, step, folder or "" if already there)
    completed: list[str] = field(default_factory=list)  # folders this process wrote the manifest of
    errors: list[str] = field(default_factory=list)
    pending: bool = False  # still writing at the deadline: abandoned, never marked complete
    no_saver: bool = False

    def saved_steps(self) -> list[int]:
        return sorted({step for _, step, _ in self.saved})

    def describe(self) -> str:
        if self.no_saver:
            return ("no dying-gasp checkpoint is configured (CheckpointConfig(exception_save=True) or "
                    "ExceptionCheckpoint), so nothing was saved")
        parts = []
        if self.saved:
            where = sorted({f for _, _, f in self.saved if f})
            parts.append(f"dying-gasp checkpoint of step {', '.join(map(str, self.saved_steps()))} saved"
                         + (f" ({', '.join(where)})" if where else " (already on disk)"))
        if self.completed:
            parts.append(f"completed (manifest written): {', '.join(self.completed)}")
        if self.errors:
            parts.append("dying-gasp save failed: " + "; ".join(self.errors))
        if self.pending:
            parts.append(f"the dying-gasp save did not finish within the grace period ({self.grace:g} s, "
                         "TG_GRACE_PERIOD / --grace-period); it is not marked complete, and the next run resumes "
                         "from the newest complete checkpoint")
        return "; ".join(parts) or "nothing to save"


def write_dying_gasp(savers, items: list[tuple], *, steps_per_epoch: int | None, world_size: int, grace: float,
                     deadline: float, settle: float | None = None) -> DumpResult:
    """Write each (snapshot, rank, own blob) with each saver, in a thread joined until `deadline`.

    Every rank writes its part into the checkpoint's shared folder; the process that wrote rank
    0's part then waits (until `deadline`) for the others and writes the manifest. A regular save
    still in flight finishes first; with `settle` (after a fault: a peer may be dead) one still
    waiting for its peers gives up after that many seconds."""
    result = DumpResult(grace=grace)
    if not savers:
        result.no_saver = True
        return result

    def work() -> None:
        for saver in savers:
            saver.settle(settle)  # a regular save still in flight comes first (it may be this very step)
            for snap, rank, own in items:
                try:
                    folder = saver.save_dying_gasp(snap, rank, own, steps_per_epoch, world_size)
                    result.saved.append((rank, snap.step, str(folder) if folder else ""))
                except (CheckpointError, OSError) as exc:
                    result.errors.append(f"rank {rank} step {snap.step}: {exc}")
                    log.error("dying-gasp checkpoint of rank %d step %d failed: %s", rank, snap.step, exc)
            done, errors = saver.commit_dying_gasp(deadline)
            result.completed += [str(f) for f in done]
            result.errors += errors

    result.pending = not run_before(deadline, work)
    return result


def run_before(deadline: float, work: Callable[[], object]) -> bool:
    """The one dying-gasp watchdog: run `work` in a thread (named GASP_THREAD) until time.monotonic()
    reaches `deadline`. True if it finished (its exception, if any, is raised here); False if it is
    still running: the caller must then leave with os._exit, so the save never completes behind its back."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name=GASP_THREAD, daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        return False
    if failure:
        raise failure[0]
    return True
