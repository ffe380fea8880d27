"""The scheduler's requests from agents: placement under `recover` (agents.py) and host beats.

A mixin of `Scheduler` (scheduler.py), which owns the cluster, the status view and `_current`, the
check that a node id and incarnation are current (and that marks it seen).
"""

from __future__ import annotations

import time

from . import membership as m
from . import protocol as p


class AgentRequests:
    def _on_agent_sync(self, req: p.AgentSync):
        return self.agents.sync(req, time.monotonic(), self.cluster.job.value, self.cluster.root_cause)

    def _on_agent_place(self, req: p.AgentPlace):
        over = self._job_over()
        return self.agents.place(req, time.monotonic(), over.message if over else "")

    def _on_host_beat(self, req: p.HostBeat):
        """The heartbeats of one host's workers, relayed by its agent (launch/relay.py): each counts as the
        worker's own heartbeat, sent `age_ms` ago; a beat for a worker of another host is refused."""
        now = time.monotonic()
        refused = []
        for beat in req.beats:
            known = self.cluster.nodes.get(beat.node_id)
            node = (self._current(beat.node_id, beat.incarnation) if known is None or known.host == req.host else
                    p.Error(code=p.ErrorCode.FENCED, message=f"node {beat.node_id!r} runs on {known.host}, "
                            f"not on {req.host}"))
            if isinstance(node, p.Error):
                refused.append(p.Refused(node_id=beat.node_id, incarnation=beat.incarnation, code=node.code.value,
                                         message=node.message))
                continue
            node.last_seen = now - beat.age_ms / 1000
            self.view.heartbeat(node.node_id, beat.step, node.last_seen)
        c = self.cluster
        return p.HostBeatAck(generation=c.generation, formed=c.formed, job_over=c.job is not m.JobState.RUNNING,
                             refused=refused)
