"""The scheduler's requests from agents: placement under `recover` (agents.py) and host beats.

A collaborator of `Scheduler` (scheduler.py), reaching it only through its public face: the cluster, the
agents' board, the status view, and `current`, the check that a node id and incarnation are current (and
that marks it seen).
"""

from __future__ import annotations

import time

from . import membership as m
from . import protocol as p
from .core import SchedulerCore


class AgentRequests:
    def __init__(self, core: SchedulerCore):
        self.core = core

    def on_agent_sync(self, req: p.AgentSync):
        c = self.core.cluster
        return self.core.agents.sync(req, time.monotonic(), c.job.value, c.root_cause)

    def on_agent_place(self, req: p.AgentPlace):
        over = self.core.job_over()
        return self.core.agents.place(req, time.monotonic(), over.message if over else "")

    def on_host_beat(self, req: p.HostBeat):
        """The heartbeats of one host's workers, relayed by its agent (launch/relay.py): each counts as the
        worker's own heartbeat, sent `age_ms` ago; a beat for a worker of another host is refused."""
        core, now = self.core, time.monotonic()
        c = core.cluster
        refused = []
        for beat in req.beats:
            known = c.nodes.get(beat.node_id)
            node = (core.current(beat.node_id, beat.incarnation) if known is None or known.host == req.host else
                    p.Error(code=p.ErrorCode.FENCED, message=f"node {beat.node_id!r} runs on {known.host}, "
                            f"not on {req.host}"))
            if isinstance(node, p.Error):
                refused.append(p.Refused(node_id=beat.node_id, incarnation=beat.incarnation, code=node.code.value,
                                         message=node.message))
                continue
            node.last_seen = now - beat.age_ms / 1000
            core.view.heartbeat(node.node_id, beat.step, node.last_seen)
        return p.HostBeatAck(generation=c.generation, formed=c.formed, job_over=c.job is not m.JobState.RUNNING,
                             refused=refused)
