"""Forming a generation (pure): when the pending generation may form, who its members are, each
one's rank and the generation's size in it, and, under `elastic`, when a smaller one may form or a
returning node makes the job grow back. The rules are in membership.py's docstring."""

from __future__ import annotations

from dataclasses import dataclass

from .membership import (
    Cluster,
    JobState,
    NodeState,
    assign_ranks,
    natural_key,
    node_order,
)


@dataclass(frozen=True, slots=True)
class Formation:
    """Whether the pending generation can form now: its members (node ids in generation-rank order),
    or None and why not; `wake_at`: when an elastic deadline will pass and the answer may change."""

    members: tuple[str, ...] | None
    reason: str
    wake_at: float | None = None


def decide_formation(cluster: Cluster, now: float = 0.0, elastic_deadline: float | None = None) -> Formation:
    """Full formation: all N alive and joined. Elastic (a deadline given): after the first formation,
    without the members dead for at least `elastic_deadline` s, if every live member has joined."""
    if cluster.formed:
        return Formation(None, f"generation {cluster.generation} is already formed")
    alive = [n for n in cluster.nodes.values() if n.state is NodeState.ALIVE]
    waiting = sorted((n.node_id for n in alive if n.node_id not in cluster.joined), key=natural_key)
    if waiting:
        return Formation(None, f"waiting for {', '.join(waiting)} to join")
    if len(alive) == cluster.worker_num:
        return Formation(tuple(n.node_id for n in sorted(alive, key=node_order)), "all members joined")
    if elastic_deadline is None:
        return Formation(None, f"{len(alive)} of {cluster.worker_num} members alive")
    if len(cluster.nodes) < cluster.worker_num or any(n.rank < 0 for n in cluster.nodes.values()):
        return Formation(None, "the cluster has never formed at full size; elastic shrinking starts after that")
    if not alive:
        return Formation(None, "no live member left")
    others = [n for n in cluster.nodes.values() if n.state is not NodeState.ALIVE]
    if any(n.state is NodeState.UNKNOWN for n in others):
        return Formation(None, "members loaded from cluster.db have not reattached yet")
    dead = [n for n in others if n.state is NodeState.DEAD]
    due = max((n.dead_since + elastic_deadline for n in dead), default=now)
    if now < due:
        late = ", ".join(n.node_id for n in sorted(dead, key=node_order))
        return Formation(None, f"{late} may come back until the elastic deadline ({due - now:.1f} s left)", due)
    members = tuple(n.node_id for n in sorted(alive, key=node_order))
    return Formation(members, f"elastic: going on with {len(members)} of {cluster.worker_num} "
                              f"(without {', '.join(n.node_id for n in sorted(dead, key=node_order))})")


def try_form(cluster: Cluster, now: float = 0.0, elastic_deadline: float | None = None) -> bool:
    """Form the pending generation if `decide_formation` allows it (ranks are fixed on the first)."""
    formation = decide_formation(cluster, now, elastic_deadline)
    if formation.members is None:
        return False
    assign_ranks(cluster)  # the first full formation fixes them
    cluster.members = tuple(sorted(formation.members, key=lambda x: node_order(cluster.nodes[x])))
    cluster.formed = True
    return True


def unknown_generation(cluster: Cluster, after: int) -> str:
    """Why a join after generation `after` is refused: a member can only have left a generation that formed.
    (Waiting on it would never end: the generation it asks to come after is never formed.)"""
    newest = cluster.generation if cluster.formed else cluster.generation - 1
    return (f"join after generation {after}: the newest generation this job formed is {newest}; a member joins "
            "after the generation it last belonged to (a stale or foreign client?)")


def generation_members(cluster: Cluster) -> tuple[str, ...]:
    """Node ids of the current generation in generation-rank order (a scheduler restarted from
    cluster.db has not stored them: every node that is not dead, by fixed rank)."""
    if cluster.members:
        return cluster.members
    return tuple(n.node_id for n in sorted(cluster.nodes.values(), key=node_order)
                 if n.state is not NodeState.DEAD and n.rank >= 0)


def generation_rank(cluster: Cluster, node_id: str) -> int:
    """The node's rank in the current generation (its fixed rank in a full one)."""
    members = generation_members(cluster)
    return members.index(node_id) if node_id in members else cluster.nodes[node_id].rank


def generation_size(cluster: Cluster) -> int:
    return len(generation_members(cluster)) or cluster.worker_num


def decide_regrow(cluster: Cluster, node_id: str) -> bool:
    """Elastic: a node just (re-)registered while a generation without it is formed, so that
    generation must end (the survivors regroup at their next commit point and take it back)."""
    return cluster.formed and node_id not in generation_members(cluster)


def elastic_job_over(cluster: Cluster) -> JobState | None:
    """Elastic: the job ends when no member is alive any more and at least one finished; the
    dead ones are not waited for (their replacements, if any, are too late). Once a generation
    agreed to finish (`finishing`), only its members are waited for."""
    nodes = [cluster.nodes[x] for x in cluster.finishing if x in cluster.nodes] or list(cluster.nodes.values())
    states = [n.state for n in nodes]
    if any(st in (NodeState.ALIVE, NodeState.UNKNOWN) for st in states):
        return None
    if not any(st in (NodeState.FINISHED, NodeState.STOPPED) for st in states):
        return None
    return JobState.STOPPED if NodeState.STOPPED in states else JobState.DONE


def never_forms(cluster: Cluster) -> str:
    """Why no further generation can ever form ("" while one can): a member already finished (or stopped) its
    training and left, so a join would wait for it until its timeout."""
    done = sorted((n for n in cluster.nodes.values() if n.state in (NodeState.FINISHED, NodeState.STOPPED)),
                  key=node_order)
    if not done:
        return ""
    names = ", ".join(f"{n.node_id} ({n.state.value})" for n in done)
    return (f"generation {cluster.generation + 1} can never form: {names} already left the job after its training; "
            "this worker came back after the others had finished")


def missing_for_formation(cluster: Cluster) -> str:
    have = {n.node_id for n in cluster.alive() if n.node_id in cluster.joined}
    missing = [n for n in cluster.nodes.values() if n.node_id not in have]
    absent = cluster.worker_num - len(cluster.nodes)
    parts = [f"{n.node_id} ({n.state.value})" for n in sorted(missing, key=node_order)]
    if absent > 0:
        parts.append(f"{absent} never registered")
    return ", ".join(parts) or "none"
