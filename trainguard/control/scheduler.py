"""The scheduler: an asyncio server that holds membership, fences stale actors and serves rendezvous.

It carries out the pure decisions of membership.py, persists every membership change (and the job's step) to
cluster.db when recovery is on, and answers blocking requests (join, agree, store waits) by waiting on one condition.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections import Counter

from ..config import ClusterConfig, check_recovery_path
from ..errors import ClusterStateError, ConfigError
from ..exitcodes import EXIT_JOB_FAILED, EXIT_PREEMPTED
from ..obs.events import EventLog
from . import auth, tls
from . import membership as m
from . import protocol as p
from .agentreqs import AgentRequests
from .agents import AgentBoard  # recover: where a dead worker starts again
from .bounds import outside_job
from .changes import Changes
from .commit import GroupCommit
from .conn import SchedulerConnection
from .db import ClusterDB
from .elastic import ElasticScheduling
from .kvstore import KVStore
from .metrics import MetricsServer
from .msgbase import for_log
from .placement import PlacementPolicy
from .rendezvous import Rendezvous
from .sched_child import drain_on_signals, kill_if_local, publish_port
from .status import JobView
from .watch import Watch

log = logging.getLogger("trainguard.scheduler")
STEP_KEPT_S = 10.0  # how often the job's committed step is written to cluster.db (one fsync), at most

MAX_CONNECTIONS_BASE = 256  # open connections beyond 4 per worker (2 each, reconnects, agents, tools)
PENDING_PER_PEER_BASE = 64  # connections of one address still in the handshake, beyond 1 per worker: one flooding
# address can never hold more than a quarter of the places (the members' 2 per worker are always left)
QUIET_REGISTRATIONS = 256  # larger jobs log first registrations at DEBUG only (10,000 lines say nothing)
LISTEN_BACKLOG = 4096  # a registration storm of thousands connects at once (the kernel caps it at somaxconn)
LINGER_MAX_S = 2.0  # a failed job's scheduler answers its survivors this long at most before it exits


class Scheduler:
    """Membership, fencing and the job's end. Two collaborators answer the other requests: the rendezvous
    (join, agree, the store: rendezvous.py) and the agents' (agentreqs.py); they reach the scheduler through
    its public methods (`current`, `job_over`, `notify`, `wait`, `persist`) and attributes."""

    def __init__(self, cfg: ClusterConfig, *, port_fd: int | None = None):
        self.cfg = cfg
        self.port_fd = port_fd  # the bound port is written there (a child of torchrun's rank 0 binds port 0)
        self.db: ClusterDB | None = None
        self.events = EventLog.null()
        cluster = None
        if cfg.enable_recovery:
            assert cfg.recovery_path is not None
            path = check_recovery_path(cfg.recovery_path)
            self.db = ClusterDB(path)
            cluster = self.db.load()
            if cluster is not None and cluster.job is not m.JobState.RUNNING:
                log.info("previous job in %s ended (%s); starting a new job", path, cluster.job.value)
                self.db.archive()
                cluster = None
            if cluster is not None and cluster.worker_num != cfg.worker_num:
                self.db.close()
                raise ClusterStateError(
                    f"{self.db.path} holds a running job of {cluster.worker_num} workers but TG_WORKER_NUM="
                    f"{cfg.worker_num} here; nothing was changed. Restart the scheduler with TG_WORKER_NUM="
                    f"{cluster.worker_num}, or move the file aside to start a new job")
            self.events = EventLog(path / "events.jsonl")
        self.resumed = cluster is not None
        # a dead worker fails the job unless the recover strategy replaces it (exit, dump, retry alone do not)
        self.replaces_dead = cfg.enable_recovery and cfg.recover_strategy.restarts
        self.cluster = cluster or m.Cluster(worker_num=cfg.worker_num)
        strategy = cfg.recover_strategy  # elastic: go on without members dead past the deadline
        self.elastic = (ElasticScheduling(strategy.elastic_deadline, self.cluster, time.monotonic())
                        if cfg.enable_recovery and strategy.elastic else None)
        self.elastic_deadline = self.elastic.deadline if self.elastic else None
        self.commits = GroupCommit(lambda touched: self.db.save(self.cluster, touched))  # one fsync a loop pass
        self.kv = KVStore()
        self.agents = AgentBoard(PlacementPolicy.from_env(os.environ), self.events)
        self._liveness: dict[int, tuple[str, int]] = {}  # id(connection) -> (node_id, incarnation)
        self._step_kept = 0.0  # when cluster.committed was last written (_keep_step)
        self._conns: set[SchedulerConnection] = set()  # open connections, closed at job end
        self._changes = Changes()  # what blocking requests wait on
        self._done: asyncio.Event | None = None
        self.port: int | None = None
        self.ready = threading.Event()
        self.view = JobView(cfg.recovery_path if self.db else None, str(cfg.recover_strategy))  # status, metrics
        self.metrics: MetricsServer | None = None
        self.max_connections = MAX_CONNECTIONS_BASE + 4 * cfg.worker_num
        self.max_pending_per_peer = PENDING_PER_PEER_BASE + cfg.worker_num
        self._pending: Counter[str] = Counter()  # peer address -> its connections in the handshake
        self.rendezvous = Rendezvous(self)
        self.watch = Watch(self, cfg.hang_timeout, cfg.heartbeat_interval)  # desyncs and hangs (waits.py)
        agents = AgentRequests(self)
        self._handlers = {  # request type -> its handler (one argument; a heartbeat's also takes its connection)
            "register": self._on_register, "reattach": self._on_reattach, "heartbeat": self._on_heartbeat,
            "report_failure": self._on_report_failure, "process_exited": self._on_process_exited,
            "finish": self._on_finish, "status": self._on_status,
            "join": self.rendezvous.on_join, "agree": self.rendezvous.on_agree, "store": self.rendezvous.on_store,
            "agent_sync": agents.on_agent_sync, "agent_place": agents.on_agent_place,
            "host_beat": agents.on_host_beat}

    # --- lifecycle ----------------------------------------------------------------

    async def serve(self) -> int:
        self._done = asyncio.Event()
        drain_on_signals(self._done, self._nobody_left, self.cfg.grace_period)
        if auth.listen_policy(self.cfg.sched_host, self.cfg.secret, self.cfg.insecure):  # raises if refused
            log.warning("no job secret: every local user can reach this scheduler on %s (set TG_JOB_SECRET_FILE "
                        "to authenticate; `trainguard run` does it for you)", self.cfg.sched_host)
        self.tls_context = tls.scheduler_context(self.cfg.tls)  # a bad certificate ends the job here, at start
        try:
            server = await asyncio.get_running_loop().create_server(
                lambda: SchedulerConnection(self, self.cfg.secret, self.tls_context), self.cfg.sched_host,
                self.cfg.sched_port, backlog=LISTEN_BACKLOG)
        except OSError as exc:
            raise ConfigError(
                f"scheduler cannot listen on {self.cfg.sched_host}:{self.cfg.sched_port} ({exc.strerror or exc}); "
                "if the port is in use (another job or a stale scheduler), free it or set TG_SCHED_PORT "
                "(MS_SCHED_PORT) to another port"
            ) from None
        self.port = server.sockets[0].getsockname()[1]
        if self.port_fd is not None:
            publish_port(self.port_fd, self.port)
        verb = "resumed" if self.resumed else "started"
        log.info("scheduler %s on %s:%d for %d workers (generation %d)", verb, self.cfg.sched_host, self.port,
                 self.cluster.worker_num, self.cluster.generation)
        self.events.emit("scheduler_started", port=self.port, resumed=self.resumed,
                          generation=self.cluster.generation, pid=os.getpid())
        self.view.announce(self.cfg.sched_host, self.port)
        if self.cfg.metrics_port is not None:
            self._publish()  # before it listens: the endpoint never serves an empty page
            self.metrics = MetricsServer(self.cfg.metrics_host or self.cfg.sched_host, self.cfg.metrics_port,
                                         lambda: self.view.snapshot)
        self.ready.set()
        monitor = asyncio.create_task(self._monitor())
        async with server:
            await self._done.wait()
            await asyncio.sleep(0.2)  # let the last replies flush
            if self.cluster.job is m.JobState.FAILED:
                await self._linger()
            for conn in list(self._conns):  # Python >= 3.12 waits on exit for every open connection
                conn.close()
        monitor.cancel()
        if self.metrics is not None:
            self.metrics.close()
        job = self.cluster.job
        self.events.emit("job_end", state=job.value, root_cause=self.cluster.root_cause)
        if job is m.JobState.FAILED:
            print(f"trainguard: job failed: {for_log(self.cluster.root_cause)}", file=sys.stderr, flush=True)
        elif job is not m.JobState.DONE:  # stopped, or still running after a stop signal (sched_child.py)
            log.info("the job stopped (%s); run it again to resume", self.cluster.root_cause or "a signal")
        elif self.cluster.finishing and len(self.cluster.finishing) < self.cluster.worker_num:  # elastic, shrunk
            log.info("the job finished with %d of its %d workers (%s; the others were left out); scheduler exits",
                     len(self.cluster.finishing), self.cluster.worker_num, ", ".join(self.cluster.finishing))
        else:
            log.info("all %d workers finished; scheduler exits", self.cluster.worker_num)
        if self.db:
            self.commits.flush()
            self.db.close()
        return {m.JobState.DONE: 0, m.JobState.STOPPED: EXIT_PREEMPTED, m.JobState.RUNNING: EXIT_PREEMPTED}.get(
            job, self.watch.verdict or EXIT_JOB_FAILED)

    def _nobody_left(self) -> bool:
        """The job is over or no worker is alive: after a stop signal, no one is left to serve."""
        return self.cluster.job is not m.JobState.RUNNING or not any(
            n.state in (m.NodeState.ALIVE, m.NodeState.UNKNOWN) for n in self.cluster.nodes.values())

    async def _linger(self) -> None:
        """A failed job: answer (status, finish) until the workers left, at most LINGER_MAX_S (survivors say goodbye)."""
        deadline = time.monotonic() + min(self.cfg.heartbeat_timeout, LINGER_MAX_S)
        while self._liveness and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def notify(self) -> None:
        """Wake every blocking request to check its condition again."""
        self._changes.notify()

    async def wait(self, predicate, deadline: float) -> bool:
        return await self._changes.wait_for(predicate, deadline)

    def persist(self, *node_ids: str) -> None:
        """Save the cluster at the end of this loop pass: the meta row, the rows of `node_ids` (none: all)."""
        if self.db:
            self.commits.changed(node_ids or None)
        if self.cluster.job is not m.JobState.RUNNING:
            self._done.set()

    async def _monitor(self) -> None:
        # an O(N) scan: every 0.1 s up to 2,000 workers, then less often, at most every half heartbeat interval
        period = min(max(0.1, self.cluster.worker_num / 20_000), self.cfg.heartbeat_interval / 2)
        while True:
            await asyncio.sleep(period)
            if self.metrics is not None:  # the endpoint's thread reads what the loop publishes
                self._publish()
            self._keep_step(time.monotonic())
            for node in m.expired(self.cluster, time.monotonic(), self.cfg.heartbeat_timeout):
                detail = f"no heartbeat for {self.cfg.heartbeat_timeout:g} s"
                self._fail(node.node_id, node.incarnation, p.FailureKind.HEARTBEAT, detail)
                kill_if_local(node.node_id, node.host, node.pid, self.port)
            if self.elastic and not self.cluster.formed:  # a dead member's deadline may have passed
                self.rendezvous.try_form()
            self.watch.check()

    def _keep_step(self, now: float) -> None:
        """The job's newest committed step into cluster.db: at the first commit, then at most every STEP_KEPT_S."""
        step, c = self.view.job_step(), self.cluster
        if step > c.committed and (not c.committed or now - self._step_kept >= STEP_KEPT_S):
            c.committed, self._step_kept = step, now
            self.persist()

    def _publish(self) -> None:
        """A fault in the metrics view is logged and never stops the failure detection that follows it."""
        try:
            self.view.tick(self.cluster, time.monotonic())
        except Exception:  # noqa: BLE001 - the job's liveness matters more than its metrics
            log.exception("the metrics snapshot failed; the endpoint keeps the previous one")

    # --- connections (conn.py) ---------------------------------------------------------------

    def connection_opened(self, conn: SchedulerConnection) -> bool:
        if len(self._conns) >= self.max_connections or self._pending[conn.address] >= self.max_pending_per_peer:
            log.warning("refused a connection from %s: %d open (limit %d), %d of them from it in the handshake "
                        "(limit %d)", conn.peer, len(self._conns), self.max_connections, self._pending[conn.address],
                        self.max_pending_per_peer)  # a flood is turned away, logged
            return False
        self._conns.add(conn)
        self._pending[conn.address] += 1
        return True

    def handshake_over(self, conn: SchedulerConnection, refused: str) -> None:
        self._pending[conn.address] -= 1
        if not self._pending[conn.address]:
            del self._pending[conn.address]
        if refused:
            log.warning("dropped a connection from %s: %s", conn.peer, refused)
            self.events.emit("connection_refused", peer=str(conn.peer)[:100], reason=refused)

    def request(self, req, conn: SchedulerConnection):
        """The reply to `req`, or (join, agree, store) a coroutine that returns it."""
        if req.type in auth.AGENT_ONLY and not conn.agent:
            return p.Error(code=p.ErrorCode.BAD_MESSAGE, message=(
                f"{req.type}: only an agent may send it, and this connection holds a worker's secret"))
        bad = outside_job(req, self.cluster.worker_num)
        if bad:
            return p.Error(code=p.ErrorCode.BAD_MESSAGE, message=bad)
        handler = self._handlers[req.type]
        return handler(req, conn) if req.type == "heartbeat" else handler(req)

    def pending_commit(self) -> asyncio.Future | None:
        return self.commits.pending()

    def connection_closed(self, conn: SchedulerConnection) -> None:
        self._conns.discard(conn)
        bound = self._liveness.pop(id(conn), None)
        if bound is not None and self.cluster.job is m.JobState.RUNNING:
            node = self.cluster.nodes.get(bound[0])
            if node is not None and node.incarnation == bound[1] and node.state is m.NodeState.ALIVE:
                self._fail(bound[0], bound[1], p.FailureKind.CONNECTION, "control connection closed")

    def current(self, node_id: str, incarnation: int) -> m.Node | p.Error:
        """The node, marked seen now, if `incarnation` is its current one and it is alive; else the error."""
        node = self.cluster.nodes.get(node_id)
        if node is None:
            return p.Error(code=p.ErrorCode.UNKNOWN_NODE, message=f"node {node_id!r} is not registered; register first")
        if node.incarnation != incarnation or node.state not in (m.NodeState.ALIVE, m.NodeState.UNKNOWN):
            return p.Error(code=p.ErrorCode.FENCED, message=(
                f"node {node_id!r} incarnation {incarnation} is stale (current {node.incarnation}, "
                f"{node.state.value}); register again"))
        if node.state is m.NodeState.UNKNOWN:  # a restarted scheduler hears from a live member
            node.state = m.NodeState.ALIVE
        node.last_seen = time.monotonic()
        return node

    def job_over(self) -> p.Error | None:
        """The error every request gets once the job has ended; None while it runs."""
        if self.cluster.job is m.JobState.RUNNING:
            return None
        why = self.cluster.root_cause or "all workers finished"
        return p.Error(code=self.watch.error_code(), message=f"the job is {self.cluster.job.value}: {why}")

    # --- membership requests ---------------------------------------------------------

    def _on_register(self, req: p.Register):
        c = self.cluster
        node_id = req.node_id or m.generated_id(c)
        now = time.monotonic()
        d = m.decide_register(c, node_id, req.worker_num, now, recovery=self.cfg.enable_recovery,
                              flap_limit=self.cfg.flap_limit, quarantine_s=self.cfg.quarantine_s)
        if d.action is m.Action.REJECT:
            log.warning("rejected registration of %s (pid %d on %s): %s", node_id, req.pid, req.host, d.reason)
            self.events.emit("register_rejected", node=node_id, code=d.code.value, reason=d.reason)
            return p.Error(code=d.code, message=d.reason, retry=d.retry)
        node = m.apply_register(c, d, req.host, req.pid, now, flap_limit=self.cfg.flap_limit,
                                quarantine_s=self.cfg.quarantine_s)
        if self.elastic and self.elastic.regrow(c, node.node_id):
            self.events.emit("generation_bumped", generation=c.generation, by=node.node_id, reason="elastic_regrow")
        self.persist(node.node_id, *([d.replaces] if d.replaces else []))
        quiet = c.worker_num > QUIET_REGISTRATIONS and node.incarnation == 1  # events.jsonl has every one
        log.log(logging.DEBUG if quiet else logging.INFO, "registered %s as incarnation %d (pid %d on %s)%s",
                node.node_id, node.incarnation, req.pid, req.host, f", replacing {d.replaces}" if d.replaces else "")
        self.events.emit("registered", node=node.node_id, rank=node.rank, incarnation=node.incarnation,
                          pid=req.pid, host=req.host, generation=c.generation)
        self.notify()
        return p.Registered(node_id=node.node_id, rank=node.rank, incarnation=node.incarnation,
                            generation=c.generation, worker_num=c.worker_num)

    def _on_reattach(self, req: p.Reattach):
        node = self.current(req.node_id, req.incarnation)
        if isinstance(node, p.Error):
            return node
        node.state, node.last_seen, node.pid = m.NodeState.ALIVE, time.monotonic(), req.pid
        log.info("%s reattached (incarnation %d)", node.node_id, node.incarnation)
        self.events.emit("reattached", node=node.node_id, generation=self.cluster.generation)
        self.notify()
        return p.Registered(node_id=node.node_id, rank=node.rank, incarnation=node.incarnation,
                            generation=self.cluster.generation, worker_num=self.cluster.worker_num)

    def _on_heartbeat(self, req: p.Heartbeat, conn: SchedulerConnection):
        node = self.current(req.node_id, req.incarnation)
        if isinstance(node, p.Error):
            return node  # else _current has marked it alive, seen now
        self.view.heartbeat(node.node_id, req.step, node.last_seen, idle=req.idle, waiting=req.waiting)
        self._liveness[id(conn)] = (node.node_id, node.incarnation)
        hang = self.watch.beat(node, req.waiting, req.idle)
        c = self.cluster
        return p.HeartbeatAck(generation=c.generation, formed=c.formed, job_over=c.job is not m.JobState.RUNNING,
                              hang=hang, verdict=self.watch.verdict or 0, stacks=self.watch.stacks_asked(node))

    def _fail(self, node_id: str, incarnation: int | None, kind: p.FailureKind, detail: str, *,
                    final: bool = False) -> None:
        c = self.cluster
        node = c.nodes.get(node_id)
        keep_on = self.replaces_dead and (not final or self.elastic is not None)  # elastic goes on without it
        d = m.decide_failure(c, node_id, incarnation, kind, detail, recovery=keep_on)
        if not (d.mark_dead or d.bump or d.fail_job):
            return
        before = c.generation
        m.apply_failure(c, node_id, d, time.monotonic())
        if d.mark_dead and node is not None:
            self.watch.forget(node.rank)
        self.persist(node_id)
        log.warning("%s", for_log(d.reason))
        self.events.emit("failure_detected", node=node_id, rank=node.rank if node else -1, kind=kind.value,
                          detail=detail[-500:], generation=before, next_generation=c.generation)
        self.notify()

    def _on_report_failure(self, req: p.ReportFailure):
        node = self.current(req.node_id, req.incarnation)
        if isinstance(node, p.Error):
            return node
        if req.kind in (p.FailureKind.NOT_EXACT, p.FailureKind.DESYNC):  # a verdict a rank found: the job ends
            self.watch.found(node, req.kind is p.FailureKind.DESYNC, req.detail)
            return p.Ok()
        self.watch.failure(node, req.at)  # two survivors failed in mismatched collectives: a desync
        if self.watch.verdict:  # the job ended on one: the reporter saves its committed state instead of rewinding
            return self.job_over()
        if req.kind is p.FailureKind.COLLECTIVE and req.generation != self.cluster.generation:
            return p.Ok()  # that generation is already over
        self._fail(req.node_id, req.incarnation, req.kind, req.detail)
        return p.Ok()

    def _on_process_exited(self, req: p.ProcessExited):
        node = self.cluster.nodes.get(req.node_id)
        if node is None or node.pid != req.pid:
            return p.Ok()  # an old incarnation, already replaced
        if node.state in (m.NodeState.FINISHED, m.NodeState.STOPPED):  # it had said goodbye: nothing to replace
            return p.Error(code=p.ErrorCode.JOB_OVER, message=f"worker {req.node_id} had already {node.state.value}")
        how = f"killed by signal {req.signal}" if req.signal else f"exited with code {req.exit_code}"
        detail = how + (f"\n{req.detail}" if req.detail else "")
        self._fail(req.node_id, node.incarnation, p.FailureKind.EXITED, detail, final=req.final)
        return p.Ok()

    def _on_finish(self, req: p.Finish):
        node = self.current(req.node_id, req.incarnation)
        if isinstance(node, p.Error):
            return p.Ok() if node.code is p.ErrorCode.FENCED else node
        if not req.ok:
            self._fail(req.node_id, req.incarnation, p.FailureKind.EXCEPTION, req.detail)
            return p.Ok()
        m.apply_finish(self.cluster, req.node_id, req.stopped, req.detail)
        if self.elastic:
            self.elastic.job_over(self.cluster)
        self.persist(req.node_id)
        self.events.emit("stopped" if req.stopped else "finished", node=req.node_id, rank=node.rank)
        self.notify()
        return p.Ok()

    def _on_status(self, req: p.Status):
        return p.StatusReply(state=self.view.status(self.cluster, time.monotonic()))
