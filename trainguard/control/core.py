"""What the scheduler's collaborators (rendezvous.py, agentreqs.py) see of it: its public face, as a Protocol.

They hold the scheduler as a `SchedulerCore`, so neither imports scheduler.py (which builds them): the
direction of imports stays scheduler -> collaborators, with no circle, deferred or not.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Protocol

from ..obs.events import EventLog
from . import membership as m
from . import protocol as p
from .agents import AgentBoard
from .elastic import ElasticScheduling
from .kvstore import KVStore
from .status import JobView


class SchedulerCore(Protocol):
    cluster: m.Cluster
    agents: AgentBoard
    view: JobView
    kv: KVStore
    events: EventLog
    elastic: ElasticScheduling | None
    elastic_deadline: float | None

    def current(self, node_id: str, incarnation: int) -> m.Node | p.Error: ...

    def job_over(self) -> p.Error | None: ...

    def notify(self) -> None: ...

    def wait(self, predicate: Callable[[], bool], deadline: float) -> Awaitable[bool]: ...

    def persist(self, *node_ids: str) -> None: ...
