"""Membership: the scheduler's state and the pure decisions made on it.

Nothing here touches a socket or a clock: callers pass `now`. Each decision returns what
to do and why; the scheduler (scheduler.py) carries it out and persists the result.

Node lifecycle (allowed transitions):

    (unknown id) --register--> ALIVE
    ALIVE   --failure-->  DEAD        (exit, closed connection, heartbeat timeout, collective report)
    ALIVE   --finish-->   FINISHED
    ALIVE   --finish(stopped)--> STOPPED  (a graceful exit on a signal; the job ends STOPPED)
    DEAD    --register--> ALIVE       (same node id, same rank, incarnation + 1)
    UNKNOWN --reattach--> ALIVE       (after a scheduler restart, same incarnation)
    UNKNOWN --timeout-->  DEAD

Rank rule: ranks are fixed when the cluster first forms. A node id that is an integer k with
0 <= k < N gets rank k; the other ids, in natural sort order, take the remaining ranks in
ascending order. A node id keeps its rank for the whole job. A new node id that arrives while
the cluster is full but one member is dead takes the rank of the lowest dead member.

Generations: a generation forms when all N members are alive and have joined it. When a
member of a formed generation dies, or a survivor reports a failed collective, the
generation number goes up and everyone must join the new one.

Elastic (recover strategy `elastic`, `elastic_deadline` seconds): once the cluster has formed,
a generation may also form without the members that have been DEAD for at least the deadline,
as long as every live member has joined and at least one is left. Such a smaller generation
numbers its members 0..n-1 in the order of their fixed ranks (surviving nodes renumbered in
node order: with node 1 of 0,1,2 gone, node 0 is rank 0 and node 2 is rank 1). A dead node that
registers again while a smaller generation runs bumps the generation (`decide_regrow`); the
next generation, formed at the survivors' next commit point, holds it again at its own rank.
A node's fixed rank (`Node.rank`) never changes; its rank in a generation is
`generation_rank`, and the generation's size `generation_size`. Formation and the generation's
members are formation.py.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

from .protocol import ErrorCode, FailureKind

FLAP_WINDOW_S = 60.0


class NodeState(enum.Enum):
    ALIVE = "alive"
    DEAD = "dead"
    FINISHED = "finished"
    STOPPED = "stopped"  # left at a commit point on a signal, after its dying-gasp checkpoint
    UNKNOWN = "unknown"  # loaded from disk by a restarted scheduler, not yet heard from


class JobState(enum.Enum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    STOPPED = "stopped"  # every worker left at a commit point on a signal: run the job again to resume


@dataclass(slots=True)
class Node:
    node_id: str
    rank: int  # -1 until the cluster first forms
    host: str
    pid: int
    incarnation: int
    state: NodeState
    last_seen: float
    admissions: list[float] = field(default_factory=list)  # times of re-admission (flapping)
    quarantined_until: float = 0.0
    failures: int = 0
    dead_since: float = 0.0  # when it was last marked DEAD (0: unknown, e.g. loaded from cluster.db)


@dataclass(slots=True)
class Cluster:
    worker_num: int
    generation: int = 1
    formed: bool = False
    nodes: dict[str, Node] = field(default_factory=dict)
    joined: set[str] = field(default_factory=set)
    job: JobState = JobState.RUNNING
    root_cause: str = ""
    next_generated_id: int = 0
    members: tuple[str, ...] = ()  # node ids of the formed generation, in generation-rank order
    finishing: tuple[str, ...] = ()  # elastic: the members whose generation agreed to finish (training done)
    committed: int = 0  # the newest step the job was seen to commit, kept in cluster.db: a rerun after every process
    # died must not start over silently (restore_plan.choose_from_disk); scheduler.py keeps it at most every 10 s


    def alive(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.state is NodeState.ALIVE]

    def by_rank(self) -> dict[int, Node]:
        return {n.rank: n for n in self.nodes.values() if n.rank >= 0}

    def describe(self) -> str:
        parts = [f"{n.node_id}(rank {n.rank}, {n.state.value})" for n in sorted(self.nodes.values(), key=node_order)]
        return ", ".join(parts) or "none"


# --- decisions ------------------------------------------------------------------


class Action(enum.Enum):
    ADMIT = "admit"  # a node id never seen before
    READMIT = "readmit"  # a dead node id comes back (or a new id replaces a dead one)
    REJECT = "reject"


@dataclass(frozen=True, slots=True)
class RegisterDecision:
    action: Action
    node_id: str = ""
    rank: int = -1
    replaces: str | None = None  # old node id whose dead slot a new id takes over
    code: ErrorCode | None = None
    retry: bool = False
    reason: str = ""


def natural_key(node_id: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", node_id))


def node_order(n: Node) -> tuple:
    return (n.rank if n.rank >= 0 else 1 << 30, natural_key(n.node_id))


def generated_id(cluster: Cluster) -> str:
    """A node id for a worker that did not set TG_NODE_ID."""
    while True:
        cluster.next_generated_id += 1
        candidate = f"auto-{cluster.next_generated_id}"
        if candidate not in cluster.nodes:
            return candidate


def decide_register(
    cluster: Cluster, node_id: str, worker_num: int, now: float, *, recovery: bool, flap_limit: int,
    quarantine_s: float,
) -> RegisterDecision:
    if cluster.job is not JobState.RUNNING:
        return RegisterDecision(Action.REJECT, node_id, code=ErrorCode.JOB_OVER,
                                reason=f"the job is {cluster.job.value}; start a new job instead")
    if cluster.finishing:
        return RegisterDecision(Action.REJECT, node_id, code=ErrorCode.JOB_OVER, reason=(
            f"the job has finished its training (generation {cluster.generation} of "
            f"{', '.join(cluster.finishing)} agreed to finish); node id {node_id!r} came back too late"))
    if worker_num != cluster.worker_num:
        return RegisterDecision(
            Action.REJECT, node_id, code=ErrorCode.MISMATCH,
            reason=(f"this worker says TG_WORKER_NUM={worker_num} but the job was started with "
                    f"{cluster.worker_num}; use the same value on every process (or clear the recovery path to start a new job)"),
        )
    node = cluster.nodes.get(node_id)
    if node is not None:
        if node.state is NodeState.ALIVE:
            return RegisterDecision(
                Action.REJECT, node_id, code=ErrorCode.DUPLICATE, retry=True,
                reason=(f"node id {node_id!r} is already registered and alive: incarnation {node.incarnation} "
                        f"(pid {node.pid} on {node.host}) is still alive; stop that process first, or give this "
                        "one another node id (TG_NODE_ID)"),
            )
        if node.state is NodeState.UNKNOWN:
            return RegisterDecision(
                Action.REJECT, node_id, code=ErrorCode.DUPLICATE, retry=True,
                reason=(f"node id {node_id!r} (incarnation {node.incarnation}, pid {node.pid}) has not yet "
                        "reattached to the restarted scheduler; it is re-admitted once known dead"),
            )
        if node.state in (NodeState.FINISHED, NodeState.STOPPED):
            return RegisterDecision(Action.REJECT, node_id, code=ErrorCode.JOB_OVER,
                                    reason=f"node id {node_id!r} already {node.state.value} its training")
        if not recovery:
            return RegisterDecision(Action.REJECT, node_id, code=ErrorCode.JOB_OVER,
                                    reason=f"node id {node_id!r} died and recovery is off (set TG_ENABLE_RECOVERY=1)")
        if node.quarantined_until > now:
            return RegisterDecision(
                Action.REJECT, node_id, code=ErrorCode.QUARANTINED, retry=True,
                reason=(f"node id {node_id!r} is quarantined for another {node.quarantined_until - now:.1f} s: it "
                        f"was re-admitted {flap_limit} times within {FLAP_WINDOW_S:.0f} s (TG_FLAP_LIMIT={flap_limit}, "
                        f"TG_QUARANTINE={quarantine_s:g} s); find why it keeps failing. It is admitted again after "
                        "the quarantine"),
            )
        return RegisterDecision(Action.READMIT, node_id, rank=node.rank)
    # a node id we have not seen
    if len(cluster.nodes) < cluster.worker_num:
        return RegisterDecision(Action.ADMIT, node_id)
    dead = sorted((n for n in cluster.nodes.values() if n.state is NodeState.DEAD), key=node_order)
    if dead and recovery:
        return RegisterDecision(Action.READMIT, node_id, rank=dead[0].rank, replaces=dead[0].node_id)
    ids = ", ".join(sorted(cluster.nodes, key=natural_key))
    return RegisterDecision(
        Action.REJECT, node_id, code=ErrorCode.FULL,
        reason=(f"cluster full: {cluster.worker_num} of {cluster.worker_num} workers are registered ({ids}); "
                "check TG_WORKER_NUM and TG_NODE_ID"),
    )


def apply_register(cluster: Cluster, d: RegisterDecision, host: str, pid: int, now: float, *,
                   flap_limit: int, quarantine_s: float) -> Node:
    if d.action is Action.ADMIT:
        node = Node(d.node_id, -1, host, pid, 1, NodeState.ALIVE, now)
        cluster.nodes[d.node_id] = node
        return node
    assert d.action is Action.READMIT
    if d.replaces is not None:
        old = cluster.nodes.pop(d.replaces)
        node = Node(d.node_id, old.rank, host, pid, old.incarnation + 1, NodeState.ALIVE, now,
                    admissions=old.admissions, failures=old.failures)
        cluster.nodes[d.node_id] = node
    else:
        node = cluster.nodes[d.node_id]
        node.host, node.pid, node.state, node.last_seen = host, pid, NodeState.ALIVE, now
        node.incarnation += 1
    node.admissions = [t for t in node.admissions if now - t < FLAP_WINDOW_S] + [now]
    if len(node.admissions) >= flap_limit:
        node.quarantined_until = now + quarantine_s
        node.admissions = []
    return node


def assign_ranks(cluster: Cluster) -> None:
    """Fix ranks for nodes that have none yet, by the documented rule."""
    if all(n.rank >= 0 for n in cluster.nodes.values()):
        return
    n = cluster.worker_num
    taken = {x.rank for x in cluster.nodes.values() if x.rank >= 0}
    pending = [x for x in cluster.nodes.values() if x.rank < 0]
    for node in pending:
        if node.node_id.isdigit() and int(node.node_id) < n and int(node.node_id) not in taken:
            node.rank = int(node.node_id)
            taken.add(node.rank)
    free = iter(r for r in range(n) if r not in taken)
    for node in sorted((x for x in pending if x.rank < 0), key=lambda x: natural_key(x.node_id)):
        node.rank = next(free)


@dataclass(frozen=True, slots=True)
class FailureDecision:
    mark_dead: bool
    bump: bool
    fail_job: bool
    reason: str


def decide_failure(cluster: Cluster, node_id: str, incarnation: int | None, kind: FailureKind,
                   detail: str, *, recovery: bool) -> FailureDecision:
    """A node (or, for COLLECTIVE, some peer of the reporter) failed. Stale reports are ignored."""
    node = cluster.nodes.get(node_id)
    if node is None or (incarnation is not None and incarnation != node.incarnation):
        return FailureDecision(False, False, False, f"stale report about {node_id!r} ignored")
    if kind is FailureKind.COLLECTIVE:
        # the reporter is alive; somebody it talks to is not (or the network hiccupped)
        return FailureDecision(False, cluster.formed, False,
                               f"{node_id} reported a failed collective in generation {cluster.generation}: {detail}")
    why = f"worker {node_id} (rank {node.rank}, pid {node.pid}) failed: {kind.value}" + (f": {detail}" if detail else "")
    if node.state is NodeState.DEAD and not recovery and cluster.job is JobState.RUNNING:
        # known dead while a replacement was still expected; now none will come (the agent gave up)
        return FailureDecision(False, False, True, why)
    if node.state not in (NodeState.ALIVE, NodeState.UNKNOWN):
        return FailureDecision(False, False, False, f"{node_id!r} is already {node.state.value}")
    return FailureDecision(True, cluster.formed, not recovery, why)


def apply_failure(cluster: Cluster, node_id: str, d: FailureDecision, now: float = 0.0) -> None:
    if d.mark_dead:
        node = cluster.nodes[node_id]
        node.state = NodeState.DEAD
        node.dead_since = now
        node.failures += 1
        cluster.joined.discard(node_id)
    if d.bump:
        bump_generation(cluster)
    if d.fail_job and cluster.job is JobState.RUNNING:
        cluster.job = JobState.FAILED
        cluster.root_cause = d.reason


def bump_generation(cluster: Cluster) -> None:
    cluster.generation += 1
    cluster.formed = False
    cluster.members = ()
    cluster.joined.clear()


def local_rank_of(cluster: Cluster, node: Node) -> int:
    same_host = sorted((n.rank for n in cluster.nodes.values() if n.host == node.host and n.rank >= 0))
    return same_host.index(node.rank) if node.rank in same_host else 0


def expired(cluster: Cluster, now: float, timeout: float) -> list[Node]:
    """Alive or not-yet-reattached nodes that have been silent longer than the heartbeat timeout."""
    cutoff = now - timeout  # one float comparison first: most nodes are not silent (4 scans a second at 10,000)
    return [n for n in cluster.nodes.values()
            if n.last_seen < cutoff and n.state in (NodeState.ALIVE, NodeState.UNKNOWN)]


def apply_finish(cluster: Cluster, node_id: str, stopped: bool = False, detail: str = "") -> None:
    """A worker finished its training cleanly, or stopped gracefully (`stopped`); the job is over when
    all N have: DONE, or STOPPED if any of them stopped."""
    node = cluster.nodes.get(node_id)
    if node is None or node.state is not NodeState.ALIVE:
        return
    node.state = NodeState.STOPPED if stopped else NodeState.FINISHED
    cluster.joined.discard(node_id)
    if stopped and not cluster.root_cause:
        cluster.root_cause = detail or f"worker {node_id} stopped on a signal"
    over = [n for n in cluster.nodes.values() if n.state in (NodeState.FINISHED, NodeState.STOPPED)]
    if len(over) == cluster.worker_num and cluster.job is JobState.RUNNING:
        stops = any(n.state is NodeState.STOPPED for n in cluster.nodes.values())
        cluster.job = JobState.STOPPED if stops else JobState.DONE
