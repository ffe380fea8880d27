"""The agent's side of the `recover` strategy: its line to the scheduler's AgentBoard (control/agents.py).

`Relocation` is the Supervisor's (agent.py) collaborator that carries placements out. A thread syncs
every `SYNC_PERIOD_S`: it tells the scheduler this agent's node rank, host, slots and the node ids it
runs, and receives the orders for it (start worker X here, placed from another host) and the job's
state. When a worker dies the agent asks `place()`, and the scheduler answers move (to which agent), in
place, or fail (with the reason). Orders are queued for the agent's loop, each once (by seq).
"""

from __future__ import annotations

import argparse
import logging
import queue
import threading
import time
from typing import Callable, Mapping, Protocol

from ..config import Role, this_host
from ..control import protocol as p
from ..control.client import Connection
from ..control.placement import PlacementPolicy
from ..errors import ProtocolError, SchedulerUnavailable
from ..strategies import Strategy
from .children import Child
from .policy import worker_cmd, worker_env

log = logging.getLogger("trainguard.agent")

SYNC_PERIOD_S = 0.1
REQUEST_TIMEOUT_S = 2.0
ORPHAN_S = 3.0  # an agent with nothing left to run stops after the scheduler has been unreachable this long


def placement_policy(args: argparse.Namespace, env: Mapping[str, str]) -> PlacementPolicy:
    """--host-fail-limit / --host-fail-window / --host-cooldown (or the job file), else TG_HOST_*, else defaults."""
    base = PlacementPolicy.from_env(env)
    given = {k: getattr(args, a) for k, a in (("fail_limit", "host_fail_limit"), ("fail_window_s", "host_fail_window"),
                                              ("cooldown_s", "host_cooldown")) if getattr(args, a, None) is not None}
    return PlacementPolicy(**{"fail_limit": base.fail_limit, "fail_window_s": base.fail_window_s,
                              "cooldown_s": base.cooldown_s, **given})


class PlacementLink:
    """Syncs with the scheduler in a thread; `orders` holds the workers to start here."""

    def __init__(self, address: tuple[str, int], agent: int, slots: int,
                 snapshot: Callable[[], tuple[list[str], list[int]]], say: Callable[[str], None],
                 secret: bytes | None = None) -> None:
        self.address, self.agent, self.slots, self.host = address, agent, slots, this_host()
        self.secret = secret
        self._snapshot = snapshot  # (node ids this agent runs, order seqs it has handled), taken atomically
        self._say = say
        self.orphan_s = ORPHAN_S
        self.orders: queue.Queue[p.Order] = queue.Queue()
        self.job, self.root_cause = "running", ""
        self.elsewhere = 0  # workers the other agents run, as of the last sync
        self.last_ok = time.monotonic()
        self._seen: set[int] = set()
        self._conn: Connection | None = None
        self._lock = threading.Lock()  # one request at a time on the connection
        self._stop = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._loop, name="tg-agent-sync", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(REQUEST_TIMEOUT_S + 1)
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    @property
    def job_running(self) -> bool:
        return self.job == "running"

    def silent_for(self) -> float:
        return time.monotonic() - self.last_ok

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sync()
            self._stop.wait(SYNC_PERIOD_S)

    def sync(self) -> None:
        with self._lock:
            running, handled = self._snapshot()
            reply = self._request(p.AgentSync(agent=self.agent, host=self.host, slots=self.slots,
                                              running=running, handled=handled))
            if not isinstance(reply, p.AgentOrders):
                return
            self.job, self.root_cause, self.elsewhere = reply.job, reply.root_cause, reply.elsewhere
            for order in reply.start:
                if order.seq not in self._seen:
                    self._seen.add(order.seq)
                    self.orders.put(order)

    def place(self, node_id: str, *, in_place_ok: bool) -> p.Placed | None:
        """Where worker `node_id`, dead here, starts again; None if the scheduler cannot be asked."""
        self.sync()  # the board knows this agent before it decides
        with self._lock:
            reply = self._request(p.AgentPlace(agent=self.agent, node_id=node_id, in_place_ok=in_place_ok))
        return reply if isinstance(reply, p.Placed) else None

    def _request(self, msg):
        try:
            if self._conn is None:
                self._conn = Connection(self.address, timeout=REQUEST_TIMEOUT_S, secret=self.secret)
            reply = self._conn.request(msg, REQUEST_TIMEOUT_S)
        except (SchedulerUnavailable, ProtocolError) as exc:
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            if not self._warned:
                self._warned = True
                log.debug("agent sync: %s", exc)
            return None
        if isinstance(reply, p.Error):
            self._say(f"the scheduler refused {msg.type}: {reply.message}")
            return None
        self.last_ok, self._warned = time.monotonic(), False
        return reply


class AgentHost(Protocol):
    """What Relocation needs of the agent (agent.py's Supervisor), all of it public."""

    children: list[Child]
    base_env: dict[str, str]

    @property
    def workers(self) -> list[Child]: ...

    @property
    def scheduler(self) -> Child | None: ...

    @property
    def stopping(self) -> bool: ...

    def restart(self, child: Child, budget: str | None = None) -> None: ...

    def report(self, child: Child, failure, *, final: bool = False, why: str = "") -> str: ...


class Relocation:
    """The `recover` strategy's part of an agent: its line to the scheduler, the question where a dead worker
    starts again, and the orders to start here the workers placed from other hosts. The Supervisor holds one
    under `recover`; it reaches the Supervisor only through AgentHost."""

    def __init__(self, host: AgentHost, spec, say: Callable[[str], None]) -> None:
        self.host = host
        self.spec = spec
        self.say = say
        self.placing = threading.Lock()  # what runs here, as the sync thread reports it
        self.handled: list[int] = []  # the placement orders carried out here
        self.link = PlacementLink((spec.sched_host, spec.sched_port), spec.node_rank, spec.capacity,
                                  self.running, say, secret=spec.secret)

    def start(self) -> None:
        self.link.start()

    def close(self) -> None:
        self.link.close()

    @property
    def failed_elsewhere(self) -> str | None:
        """The job's root cause when it failed on another host (the scheduler says), else None."""
        return self.link.root_cause if self.link.job == "failed" else None

    def running(self) -> tuple[list[str], list[int]]:
        with self.placing:
            return ([w.node_id or "" for w in self.host.workers if not w.done and not w.placing], list(self.handled))

    def place(self, child: Child, failure) -> str:
        """Ask the scheduler where the dead worker starts again: "here", "moved", or why it cannot."""
        in_place_ok = Strategy.RECOVER_IN_PLACE in self.spec.recover_strategy.chosen
        with self.placing:
            child.placing = True
        placed = self.link.place(child.node_id or "", in_place_ok=in_place_ok)
        with self.placing:
            child.placing = False
            if placed is not None and placed.action == "move":
                child.done = True
        if placed is None:
            if in_place_ok:
                self.say(f"cannot ask the scheduler where {child.name} should go; restarting it here")
                return "here"
            reason = f"cannot ask the scheduler at {self.spec.sched_host}:{self.spec.sched_port} where it should go"
        elif placed.action == "move":
            self.say(f"{child.name} goes to the agent of node rank {placed.target}: {placed.reason}")
            return "moved"
        elif placed.action == "in_place":
            self.say(f"{child.name}: {placed.reason}")
            return "here"
        else:
            reason = placed.reason
        self.host.report(child, failure, final=True, why=reason)
        return f"{child.name} is not replaced: {reason}"

    def take_orders(self) -> None:
        """Start the workers the scheduler placed here (each keeps its node id, hence its rank)."""
        while not self.host.stopping:
            try:
                order = self.link.orders.get_nowait()
            except queue.Empty:
                return
            with self.placing:
                child = self.placed_worker(order.node_id)
                if child.alive():
                    self.say(f"asked to start {child.name}, which still runs here; ignored")
                child.done = False
                self.handled.append(order.seq)
            if not child.alive():
                self.host.restart(child, f"placed here by the scheduler: it died on node rank {order.origin}")

    def may_end(self) -> bool:
        """Every worker here has left: the agent ends, except while the job still runs on other hosts (one of
        their dead workers may be placed here; and the scheduler, if here, must stay)."""
        if not self.link.job_running or not self.link.elsewhere:
            return True
        sched = self.host.scheduler
        if sched is not None:
            return not sched.alive()
        if self.link.silent_for() > self.link.orphan_s:
            self.say(f"nothing runs here and the scheduler has not answered for {self.link.silent_for():.0f} s; "
                     "stopping")
            return True
        return False

    def placed_worker(self, node_id: str) -> Child:
        """The child for a worker placed here from another host. It keeps its node id (so its rank) and gets the
        lowest local rank no running worker here has."""
        workers = self.host.workers
        taken = {w.index for w in workers if not w.done}
        index = next(i for i in range(len(workers) + 1) if i not in taken)
        env = worker_env(self.host.base_env, self.spec, index, node_id=node_id)
        child = next((w for w in workers if w.node_id == node_id), None)
        if child is None:
            child = Child(Role.WORKER, index, node_id, worker_cmd(self.spec), env)
            self.host.children.append(child)
        elif not child.alive():
            child.index, child.env = index, env
        return child
