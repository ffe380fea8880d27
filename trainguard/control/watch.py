"""The scheduler's watch over desyncs and hangs: it keeps what each rank last said it waits in, asks the pure
decisions of waits.py, and carries their verdicts out.

- A desync seen after a recovery (the ranks may have come back disagreeing) is repaired once by a rewind of
  every rank; seen again at the same step, or with no recovery before it, it ends the job: the root cause
  names both ranks' calls, the event is `desync`, and every process exits EXIT_DESYNC. The generation is
  moved on in both cases, so ranks blocked in the mismatched collectives are cut loose at once
  (their heartbeat threads cut the group) instead of at the backend's timeout.
- A replay that differed from its first run, under `--exact strict` (train/engine/audit.py), ends the job
  the same way, with EXIT_NOT_EXACT.
- A hang (TG_HANG_TIMEOUT, `--hang-timeout`; off by default) is told to the hung worker in its next
  heartbeat's reply: it prints its stacks and kills itself (worker/hang.py), and is replaced as a dead
  worker is.

A failure report's collective is kept per generation: two survivors of an abort (gloo ends a rank at once on
a size mismatch) that failed at the same collective number with other calls show the desync there. A rank
still blocked in a collective of a generation the job has left (gloo did not fail it: its peer that aborted
was not its neighbour) says so in its heartbeats, and that wait is compared with the failures the same way.
"""

from __future__ import annotations

import logging
import time

from ..exitcodes import EXIT_DESYNC, EXIT_NOT_EXACT
from . import formation as fm
from . import membership as m
from . import protocol as p
from .msgbase import for_log
from .waits import ADVICE, Desync, Waiting, find_desync, find_hang, mismatch, rewind_first

log = logging.getLogger("trainguard.scheduler")

SLOW_FORMATION_S = 30.0  # a generation not formed after this long is said once, with the members it waits for
SETTLE_S = 5.0  # waits this long at different collectives are no race: ranks a moment apart never look so, even
# on a loaded machine (the same collective with other calls needs no wait: it is a desync at once)


class Watch:
    def __init__(self, scheduler, hang_timeout: float | None, heartbeat_interval: float):
        self.s = scheduler
        self.hang_timeout = hang_timeout
        self.settle = max(SETTLE_S, 5 * heartbeat_interval)
        self.waits: dict[int, Waiting] = {}  # rank -> the collective it waits in (current generation only)
        self.idle: dict[int, float] = {}  # rank -> seconds without progress, as its last heartbeat said
        self.failed: dict[int, Waiting] = {}  # rank -> the collective that failed, in generation `failed_gen`
        self.failed_gen = -1
        self.hung: dict[tuple[str, int], str] = {}  # (node id, incarnation) -> why it is hung (told in its next
        # heartbeat's reply; its replacement is another incarnation)
        self.repaired_at: int | None = None  # the job step of the last repair by a rewind
        self.verdict: int | None = None  # the exit code of the verdict that ended the job (EXIT_DESYNC, EXIT_NOT_EXACT)
        self.forming: tuple[int, float] = (0, 0.0)  # (generation, since when) of the generation not formed yet
        self.late: set[tuple[str, int]] = set()  # (node id, incarnation) of live members a slow formation waits for:
        # told in their next heartbeat's reply to print their stacks

    # --- inputs ---------------------------------------------------------------------------

    def beat(self, node: m.Node, waiting: Waiting | None, idle: float | None) -> str:
        """A member's heartbeat; returns why it is hung ("" if it is not)."""
        c = self.s.cluster
        if waiting is not None and waiting.generation == c.generation and c.formed:
            self.waits[node.rank] = waiting
        else:
            self.waits.pop(node.rank, None)
            if waiting is not None and waiting.generation < c.generation:  # left behind in a cut generation's
                self.failure(node, waiting)  # collective: where it stopped counts as a failure report does
        if idle is not None:
            self.idle[node.rank] = idle
        return self.hung.get((node.node_id, node.incarnation), "")

    def stacks_asked(self, node: m.Node) -> bool:
        """Is this member to print its stacks (once: a slow formation waits for it)?"""
        key = (node.node_id, node.incarnation)
        if key in self.late:
            self.late.discard(key)
            return True
        return False

    def failure(self, node: m.Node, at: Waiting | None) -> None:
        """A survivor's collective failed at `at` (or it is still blocked there, in a generation left behind)."""
        if at is None:
            return
        if at.generation < self.failed_gen:
            return
        if at.generation > self.failed_gen:
            self.failed, self.failed_gen = {}, at.generation
        self.failed[node.rank] = at
        found = mismatch(self.failed)
        if found is not None:
            self.failed = {}
            self.desync(found, "their failed collectives")

    def forget(self, rank: int) -> None:
        """A member left (dead or finished): what it said no longer stands."""
        self.waits.pop(rank, None)
        self.idle.pop(rank, None)

    # --- the scan (the scheduler's monitor) -------------------------------------------------------

    def check(self) -> None:
        c = self.s.cluster
        if c.job is m.JobState.RUNNING and not c.formed:
            self._slow_formation(c)
        if c.job is not m.JobState.RUNNING or not c.formed:
            return
        alive = {n.rank for n in c.alive()}
        waits = {r: w for r, w in self.waits.items() if r in alive and w.generation == c.generation}
        finished = sorted(n.rank for n in c.nodes.values() if n.state is m.NodeState.FINISHED)
        found = find_desync(waits, finished, self.settle)
        if found is not None:
            self.desync(found, "their waits")
            return
        hang = find_hang({r: s for r, s in self.idle.items() if r in alive}, waits, self.hang_timeout, self.settle)
        if hang is not None:
            rank, seconds = hang
            node = c.by_rank().get(rank)
            if node is not None and (node.node_id, node.incarnation) not in self.hung:
                why = (f"rank {rank} made no progress (no collective, step or batch) for {seconds:.0f} s while "
                       f"its peers wait for it (hang timeout {self.hang_timeout:g} s)")
                self.hung[(node.node_id, node.incarnation)] = why
                log.warning("%s; it prints its stacks and is replaced", why)
                self.s.events.emit("hang_detected", node=node.node_id, rank=rank, idle_s=round(seconds, 1),
                                   generation=c.generation)

    def _slow_formation(self, c: m.Cluster) -> None:
        """Say once which members a generation still waits for after SLOW_FORMATION_S; the live ones that have
        not joined print their stacks (told in their heartbeat's reply), so the log shows where they are."""
        now = time.monotonic()
        gen, since = self.forming
        if gen != c.generation:
            self.forming = (c.generation, now)
        elif since and now - since >= SLOW_FORMATION_S:
            self.forming = (gen, 0.0)
            missing = fm.missing_for_formation(c)
            log.warning("generation %d has waited %.0f s to form; missing: %s", gen, now - since, missing)
            self.late = {(n.node_id, n.incarnation) for n in c.alive() if n.node_id not in c.joined}
            self.s.events.emit("slow_formation", generation=gen, waited_s=round(now - since, 1), missing=missing)

    # --- verdicts -------------------------------------------------------------------------------

    def desync(self, found: Desync, seen_in: str) -> None:
        c = self.s.cluster
        if c.job is not m.JobState.RUNNING:
            return
        step = self.s.view.job_step()
        repair = rewind_first(found.generation, step, self.repaired_at)
        text = f"desync: {found.text}"
        self.s.events.emit("desync", ranks=list(found.ranks), detail=text[-1000:], generation=c.generation,
                           step=step, action="rewind" if repair else "end", seen_in=seen_in)
        if repair:
            self.repaired_at = step
            log.warning("%s; a recovery came before it, so every rank goes back to its last commit once",
                        for_log(text))
            self._move_on()
        else:
            log.error("%s; the job ends (a bug in the script is never healed as a fault)", for_log(text))
            self.end(EXIT_DESYNC, f"{text}. Likely cause: {ADVICE}")

    def found(self, node: m.Node, desync: bool, detail: str) -> None:
        """A verdict `node` found: its ranks' updates parted (`desync`: train/engine/lockstep.py), or under --exact
        strict it replayed a step that differed from its first run (train/engine/audit.py)."""
        if self.s.cluster.job is m.JobState.RUNNING:
            log.error("rank %d: %s; the job ends (%s)", node.rank, for_log(detail),
                      "a bug in the script is never healed as a fault" if desync else "--exact strict")
            self.end(EXIT_DESYNC if desync else EXIT_NOT_EXACT, f"rank {node.rank}: {detail}")

    def end(self, verdict: int, root_cause: str) -> None:
        """End the job on a verdict about the script; every process exits `verdict`."""
        c = self.s.cluster
        self.verdict = verdict
        c.job, c.root_cause = m.JobState.FAILED, root_cause
        self._move_on()

    def error_code(self) -> p.ErrorCode:
        """What a request gets once the job is over."""
        return {EXIT_DESYNC: p.ErrorCode.DESYNC, EXIT_NOT_EXACT: p.ErrorCode.NOT_EXACT}.get(self.verdict,
                                                                                            p.ErrorCode.JOB_OVER)

    def _move_on(self) -> None:
        self.waits.clear()
        m.bump_generation(self.s.cluster)  # ranks blocked in a collective are cut loose now (their heartbeats say so)
        self.s.persist()
        self.s.notify()
