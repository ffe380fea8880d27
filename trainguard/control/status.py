"""What the scheduler tells `trainguard status` and the metrics endpoint: membership from its own
state, the step from heartbeats, and recoveries, checkpoints and hot spares from events.jsonl
(EventTail: the events of the scheduler's host; give every host the same --recovery-path on a
shared filesystem to see all of them).

The scheduler also writes `<recovery path>/scheduler.json` (host, port, pid) when it starts, so
that `trainguard status RECOVERY_PATH` finds it; the job secret next to it authenticates the query.
"""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path
from typing import Any

from .. import durable
from ..obs.events import EventTail
from ..obs.timeline import build, verdict_line
from . import membership as m
from .msgbase import INT64_MAX

RATE_WINDOW_S = 30.0  # the step rate is measured over this much recent time
SAMPLE_EVERY_S = 1.0
SCHEDULER_FILE = "scheduler.json"


class JobView:
    def __init__(self, recovery_path: Path | None, strategy: str):
        self.recovery_path = recovery_path
        self.strategy = strategy
        self.tail = EventTail(recovery_path / "events.jsonl" if recovery_path is not None else None)
        self.started = time.monotonic()
        self.steps: dict[str, tuple[int, float]] = {}  # node id -> (last step it reported, when)
        self.waits: dict[str, tuple[float | None, str]] = {}  # node id -> (seconds without progress, what it waits in)
        self.samples: deque[tuple[float, int]] = deque()  # (time, job step), at most one a second
        self.steps_done = 0  # steps finished, counting those redone after a recovery (monotonic)
        self._recoveries: list[dict] = []
        self._verdicts: list[str] = []  # replay mismatches, desyncs, hangs (obs/timeline.verdict_line)
        self._tail_size = -1
        self.snapshot: dict[str, Any] = {}  # the latest published view (read by the metrics thread)
        self._published = 0.0

    # --- inputs ---------------------------------------------------------------------------

    def announce(self, host: str, port: int) -> None:
        """Write scheduler.json (owner-only, replaced atomically) for `trainguard status`."""
        if self.recovery_path is None:
            return
        path = self.recovery_path / SCHEDULER_FILE
        durable.write_json(path, {"host": host, "port": port, "pid": os.getpid()}, mode=0o600)

    def job_step(self) -> int:
        """The newest step any member said it committed (0 before any)."""
        return max((s for s, _ in self.steps.values()), default=0)

    def heartbeat(self, node_id: str, step: int, now: float, idle: float | None = None, waiting=None) -> None:
        """A member's heartbeat said it has committed `step` steps (-1: not training yet), made no progress for
        `idle` seconds, and waits in `waiting` (control/waits.py). O(1): the job's step (the members' largest)
        is taken at most once a second, as a sample."""
        self.waits[node_id] = (idle, f"{waiting.op} at {waiting.site} for {waiting.for_s:.1f} s" if waiting else "")
        if step < 0:
            return
        self.steps[node_id] = (step, now)
        if self.samples and now - self.samples[-1][0] < SAMPLE_EVERY_S:
            return
        job_step = max(s for s, _ in self.steps.values())
        if self.samples and job_step > self.samples[-1][1]:  # saturates: a member that sends int64's top and
            # then 0, again and again, must not make the view leave int64 (msgpack, JSON readers)
            self.steps_done = min(INT64_MAX, self.steps_done + job_step - self.samples[-1][1])
        self.samples.append((now, job_step))
        while now - self.samples[0][0] > RATE_WINDOW_S:
            self.samples.popleft()

    # --- views ------------------------------------------------------------------------------

    def step_rate(self) -> float | None:
        """Steps per second over the window (None until two samples exist); a step count that went back
        (steps lost to a recovery) restarts the measurement there."""
        pts = list(self.samples)
        for i in range(len(pts) - 1, 0, -1):
            if pts[i][1] < pts[i - 1][1]:
                pts = pts[i:]
                break
        if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
            return None
        return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])

    def recoveries(self) -> list[dict]:
        self.tail.update()
        if len(self.tail.events) != self._tail_size:  # only a recovery's events change the recoveries
            self._tail_size = len(self.tail.events)
            tl = build(self.tail.events)
            self._recoveries = [{"index": r.index, "ts": r.start, "cause": r.cause,
                                 "ranks": [f.get("rank") for f in r.failures if f.get("kind") != "collective"],
                                 "generation": r.generation, "mttr_s": r.mttr_s, "total_s": r.total_s,
                                 "lost_steps": r.lost_steps, "to_step": r.to_step, "sources": r.sources,
                                 "phases": {p.name: round(p.seconds, 4) for p in r.phases}}
                                for r in tl.recoveries]
            self._verdicts = [verdict_line(e) for e in tl.verdicts]
        return self._recoveries

    def status(self, c: m.Cluster, now: float) -> dict[str, Any]:
        nodes = []
        for n in sorted(c.nodes.values(), key=lambda n: n.rank):
            step, _ = self.steps.get(n.node_id, (None, None))
            idle, waiting = self.waits.get(n.node_id, (None, ""))
            nodes.append(dict(node_id=n.node_id, rank=n.rank, host=n.host, pid=n.pid, incarnation=n.incarnation,
                              state=n.state.value, failures=n.failures, step=step,
                              heartbeat_age_s=round(now - n.last_seen, 3),
                              idle_s=round(idle, 1) if idle is not None else None, waiting=waiting))
        rate = self.step_rate()
        return dict(generation=c.generation, formed=c.formed, job=c.job.value, worker_num=c.worker_num,
                    root_cause=c.root_cause, strategy=self.strategy, nodes=nodes, scheduler_pid=os.getpid(),
                    uptime_s=round(now - self.started, 1), step=self.job_step() if self.steps else None,
                    step_rate=round(rate, 3) if rate is not None else None, steps_done=self.steps_done,
                    spares={str(a): n for a, n in sorted(self.tail.spares.items())}, recoveries=self.recoveries(),
                    verdicts=self._verdicts,
                    checkpoints=list(self.tail.checkpoints))

    def tick(self, c: m.Cluster, now: float) -> None:
        """Publish a fresh snapshot for the metrics thread, at most once a second (from the event loop)."""
        if now - self._published >= SAMPLE_EVERY_S:
            self._published = now
            self.snapshot = self.status(c, now)
