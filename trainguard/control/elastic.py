"""The scheduler's part of the `elastic` recover strategy: go on with fewer workers, grow back later.

The decisions are the pure functions of membership.py (`decide_formation` with a deadline,
`decide_regrow`, `elastic_job_over`); this module carries them out for the scheduler, which
calls it from a few hooks:

- a member's death stamps `Node.dead_since`; members loaded from cluster.db after a scheduler
  restart get the restart time, so a restart never shortens the deadline, and a formed generation
  gets its member list back (every node not dead at load, in fixed-rank order);
- the monitor tick (every 0.1 s) tries to form the pending generation, so survivors waiting on
  a dead member are answered as soon as its deadline passes: a smaller generation, ranks
  0..n-1 in fixed-rank order;
- a registration of a node that is not in the formed generation ends that generation (bump),
  so the survivors regroup at their next commit point and the job grows back;
- a finish agreement: its generation's members are recorded; from then on registrations are
  refused (a replacement that comes back now is too late: training is done);
- a finish: the job is over once no member is alive any more, without waiting for dead ones.

The worker side (re-sharding the rest of the epoch, restoring a returning node from a peer)
is in train/engine/session.py and train/data/sampler.py.
"""

from __future__ import annotations

import logging

from . import formation as fm
from . import membership as m

log = logging.getLogger("trainguard.scheduler")


class ElasticScheduling:
    def __init__(self, deadline: float, cluster: m.Cluster, now: float):
        self.deadline = deadline
        for node in cluster.nodes.values():  # loaded from cluster.db: the clock starts now
            if node.state is m.NodeState.DEAD and node.dead_since <= 0:
                node.dead_since = now
        if cluster.formed and not cluster.members:  # cluster.db keeps no member list: those not dead at load
            cluster.members = fm.generation_members(cluster)

    def regrow(self, cluster: m.Cluster, node_id: str) -> bool:
        """A node registered: if the formed generation runs without it, end that generation."""
        if not fm.decide_regrow(cluster, node_id):
            return False
        log.info("elastic: %s is back; generation %d (%d workers) ends at the next commit point", node_id,
                 cluster.generation, fm.generation_size(cluster))
        m.bump_generation(cluster)
        return True

    def finishing(self, cluster: m.Cluster) -> None:
        """The current generation agreed that training is done."""
        cluster.finishing = fm.generation_members(cluster)

    def job_over(self, cluster: m.Cluster) -> bool:
        """After a finish: end the job if every live member has left (dead ones are not waited for)."""
        if cluster.job is not m.JobState.RUNNING:
            return False
        state = fm.elastic_job_over(cluster)
        if state is None:
            return False
        cluster.job = state
        return True
