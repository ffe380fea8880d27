"""An agent's messages to the scheduler: placement under the `recover` strategy (placement.py,
agents.py), and its host's heartbeats (launch/relay.py).

A host beat carries the heartbeats of every worker on the agent's host that beat since the last one:
at 10,000 workers and 8 a host, 2,500 frames a second instead of 20,000 (bench/scheduler_scale.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .msgbase import (
    MAX_SLOTS,
    MAX_WORKER_NUM,
    BeatStep,
    Generation,
    Host,
    Incarnation,
    Msg,
    NodeId,
    NodeRank,
    Seq,
    Slots,
    Text,
)

MAX_HOST_BEATS = 4096  # workers in one host beat


class AgentSync(Msg):
    """From an agent, every few tenths of a second under `recover`: what it runs; answered with its orders."""

    type: Literal["agent_sync"] = "agent_sync"
    agent: NodeRank  # its node rank (below the job's worker count: bounds.py)
    host: Host
    slots: Slots
    running: list[NodeId] = Field(default_factory=list, max_length=MAX_SLOTS)
    handled: list[Seq] = Field(default_factory=list, max_length=MAX_SLOTS)  # order seqs it has carried out


class AgentPlace(Msg):
    """From an agent whose worker died under `recover`: where does it start again?"""

    type: Literal["agent_place"] = "agent_place"
    agent: NodeRank
    node_id: NodeId
    in_place_ok: bool = False


class Beat(Msg):
    node_id: NodeId
    incarnation: Incarnation
    step: BeatStep
    age_ms: int = Field(ge=0, le=3_600_000)  # how long ago the worker beat to its agent


class HostBeat(Msg):
    """From an agent, every heartbeat interval: the workers of its host that beat since the last one."""

    type: Literal["host_beat"] = "host_beat"
    host: Host
    beats: list[Beat] = Field(max_length=MAX_HOST_BEATS)


# --- replies


class Order(Msg):
    seq: Seq
    node_id: NodeId
    origin: NodeRank  # the agent it died on


class AgentOrders(Msg):
    type: Literal["agent_orders"] = "agent_orders"
    start: list[Order] = Field(default_factory=list, max_length=MAX_SLOTS)
    job: str = Field("running", max_length=64)
    root_cause: Text = ""
    elsewhere: int = Field(0, ge=0, le=MAX_WORKER_NUM)  # workers running on (or placed on) the other live agents


class Placed(Msg):
    type: Literal["placed"] = "placed"
    action: Literal["move", "in_place", "fail"]
    target: NodeRank | None = None
    reason: Text = ""


class Refused(Msg):
    node_id: NodeId
    incarnation: Incarnation
    code: str = Field(max_length=64)
    message: Text


class HostBeatAck(Msg):
    """The generation, as a heartbeat ack says it, for every worker of the host; and the beats refused
    (a fenced or unknown incarnation), each as the worker's own heartbeat would have been refused."""

    type: Literal["host_beat_ack"] = "host_beat_ack"
    generation: Generation
    formed: bool
    job_over: bool = False
    refused: list[Refused] = Field(default_factory=list, max_length=MAX_HOST_BEATS)
