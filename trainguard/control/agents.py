"""The scheduler's view of the agents, for the `recover` strategy: who runs what, who failed, who is excluded.

Agents sync every few tenths of a second (`AgentSync`: node rank, host, slots, the node ids they run,
the orders they have carried out) and get back the orders for them (`Order`: start this node id) and
the job's state. An agent whose worker died asks `AgentPlace`; `placement.choose_host` decides and
`AgentBoard` carries it out: it counts the failure against the origin, and for a move it queues an
order for the target, which counts against the target's slots until the target reports it handled.

The board lives in memory only. After a scheduler restart the agents' next syncs rebuild it; an order
queued but not yet delivered when the scheduler died is lost (the job then waits for that worker).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..obs.events import EventLog
from . import protocol as p
from .placement import HostView, Place, PlacementPolicy, became_excluded, choose_host

log = logging.getLogger("trainguard.scheduler")
KEEP_FAILURES = 64  # per host; exclusion looks at the newest fail_limit of them


@dataclass(slots=True)
class _Agent:
    agent: int
    host: str
    slots: int
    running: set[str] = field(default_factory=set)
    failures: list[float] = field(default_factory=list)
    last_seen: float = 0.0


@dataclass(frozen=True, slots=True)
class _Pending:
    seq: int
    node_id: str
    origin: int
    target: int


class AgentBoard:
    def __init__(self, policy: PlacementPolicy, events: EventLog) -> None:
        self.policy = policy
        self.events = events
        self.agents: dict[int, _Agent] = {}
        self.pending: list[_Pending] = []
        self._seq = 0

    def view(self, now: float) -> list[HostView]:
        views = []
        for a in self.agents.values():
            placed = {o.node_id for o in self.pending if o.target == a.agent}
            views.append(HostView(a.agent, a.host, a.slots, len(a.running | placed), tuple(a.failures), a.last_seen))
        return views

    def sync(self, req: p.AgentSync, now: float, job: str, root_cause: str) -> p.AgentOrders:
        a = self.agents.get(req.agent)
        if a is None:
            a = self.agents[req.agent] = _Agent(req.agent, req.host, req.slots)
            log.info("agent of node rank %d (%s) syncs: %d slots, running %s", req.agent, req.host, req.slots,
                     sorted(req.running) or "nothing")
        a.host, a.slots, a.running, a.last_seen = req.host, req.slots, set(req.running), now
        done = set(req.handled)
        self.pending = [o for o in self.pending if not (o.target == req.agent and o.seq in done)]
        orders = [p.Order(seq=o.seq, node_id=o.node_id, origin=o.origin) for o in self.pending
                  if o.target == req.agent]
        elsewhere = sum(h.used for h in self.view(now)
                        if h.agent != req.agent and now - h.last_seen <= self.policy.agent_timeout_s)
        return p.AgentOrders(start=orders, job=job, root_cause=root_cause, elsewhere=elsewhere)

    def place(self, req: p.AgentPlace, now: float, job_over: str = "") -> p.Placed:
        """`job_over`: why the job is no longer running (then nothing is placed), else empty."""
        if job_over:
            return p.Placed(action="fail", reason=job_over)
        origin = self.agents.get(req.agent)
        if origin is None:  # never synced (it died within the first sync period): known from now on
            return p.Placed(action="in_place" if req.in_place_ok else "fail", target=req.agent,
                            reason="the agent has not synced with the scheduler yet, so no other host is known")
        before = list(origin.failures)
        origin.failures = (origin.failures + [now])[-max(KEEP_FAILURES, self.policy.fail_limit):]
        origin.running.discard(req.node_id)
        until = became_excluded(before, origin.failures, now, self.policy)
        if until:
            log.warning("host of node rank %d (%s) excluded for %g s: %d worker failures within %g s", origin.agent,
                        origin.host, self.policy.cooldown_s, self.policy.fail_limit, self.policy.fail_window_s)
            self.events.emit("host_excluded", agent=origin.agent, host=origin.host, failures=len(origin.failures),
                              cooldown=self.policy.cooldown_s, window=self.policy.fail_window_s)
        d = choose_host(self.view(now), origin.agent, now, self.policy, in_place_ok=req.in_place_ok)
        self.events.emit("placement", node=req.node_id, origin=origin.agent, action=d.action.value,
                          target=d.target, reason=d.reason)
        log.info("worker %s died on node rank %d: %s", req.node_id, origin.agent, d.reason)
        if d.action is Place.MOVE:
            self._seq += 1
            self.pending.append(_Pending(self._seq, req.node_id, origin.agent, d.target))
        elif d.action is Place.IN_PLACE:
            origin.running.add(req.node_id)
        return p.Placed(action=d.action.value, target=d.target, reason=d.reason)
