"""The worker runtime behind `trainguard.init()`.

It registers with the scheduler, keeps a heartbeat, learns rank and world size, and builds the torch process group of
each generation under a fresh store prefix. On a failure it drops the broken group and joins the next generation.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.distributed_c10d import _set_pg_timeout

from .. import config as C
from .. import rewinding
from ..control import protocol as p
from ..control.client import Heartbeater, SchedulerClient
from ..control.outcomes import ErrorDecision
from ..control.reports import ErrorReport
from ..errors import ClusterFailed, ConfigError, FencedError, SchedulerUnavailable, TrainguardError
from ..obs.events import EventLog
from . import collectives, embedded, generators, graveyard, prologue
from .hang import LeftBehind, die_hung, dump_on_request, print_stacks
from .ledger import beat, failed_at, ledger
from .mpchild import refuse_a_rerun_by_multiprocessing
from .sever import GroupSockets, open_sockets, scheduler_peers
from .store import SchedulerStore, generation_prefix, leave_together

log = logging.getLogger("trainguard.worker.runtime")

_runtime: "Runtime | None" = None
MAX_BUILD_FAILURES = 5
LEAVE_TOGETHER_S = 5.0  # at most this long a rank that ends its script waits for its peers to end theirs (store.py)
ERROR_VOTE_S = 30.0  # how long a rank whose script raised waits to learn whether every rank raised the same


class Runtime:
    def __init__(self, cfg: C.ClusterConfig):
        self.cfg = cfg
        # rank 0 under torchrun/mpirun: the scheduler child it supervises (sched_child.py), and torchrun's store
        # that publishes its port (kept: if this rank hosts that store, it must outlive the call)
        self.scheduler, self._launch_store, cfg = embedded.scheduler_for(cfg)
        self.cfg = cfg
        self.address = (cfg.sched_host, cfg.sched_port)
        self.client = SchedulerClient(self.address, connect_timeout=cfg.connect_timeout, secret=cfg.secret)
        if cfg.recovery_path is not None:  # unusable: a ConfigError naming the variable, at start
            self.events = EventLog(C.check_recovery_path(cfg.recovery_path) / "events.jsonl")
        else:
            self.events = EventLog.null()
        self.generation = 0
        self.rank = -1
        self.world_size = 0
        self.local_rank = 0
        self.group: dist.ProcessGroup | None = None
        self._groups: list[dist.ProcessGroup] = []  # the groups made after it in this generation
        self.members: frozenset[tuple[str, int]] = frozenset()  # (node id, incarnation) of the formed generation
        self._sockets = GroupSockets({})
        self.backend = ""
        self._abort_lock = threading.Lock()
        self._aborted = 0  # the generation whose NCCL communicators were aborted
        self.step = -1
        self.finished = False
        self.rejoin = False  # the script goes back to its committed step: join the next generation at init()
        self.in_step = False  # this rank regroups from inside its step (train/engine/instep.py): it says so (announce)
        self.verdict = 0  # the exit code of a verdict that ended the job, as a failure report's reply said
        self._error: str = ""
        self._register()

    # --- membership ------------------------------------------------------------------------

    def _register(self) -> None:
        # a predecessor that died silently is known dead within one heartbeat timeout; a live one is a mistake
        reply = self.client.register(node_id=self.cfg.node_id, host=C.this_host(), pid=os.getpid(),
                                     worker_num=self.cfg.worker_num, duplicate_wait=2 * self.cfg.heartbeat_timeout)
        self.node_id, self.incarnation = reply.node_id, reply.incarnation
        log.info("registered as %s (incarnation %d)", self.node_id, self.incarnation)
        self.heart = Heartbeater(self.address, self.client.identity, self.cfg.heartbeat_interval,
                                 step_fn=lambda: self.step, on_news=self._on_news, secret=self.cfg.secret,
                                 relay=self.cfg.beat_socket, on_hang=die_hung, on_stacks=print_stacks,
                                 waits_fn=lambda: beat(self.cfg.heartbeat_interval),
                                 on_beat=LeftBehind(lambda: self.generation, lambda: self.heart.generation_seen,
                                                    max(10.0, 2 * self.cfg.heartbeat_timeout)).check)
        self.heart.start()

    def form(self) -> p.Formed:
        """Join the next generation and build its process group."""
        failures: list[str] = []
        while True:
            if self.heart.fenced:
                self._reregister()
            try:
                formed = self.client.join(after=self.generation, timeout=self.cfg.join_timeout)
            except FencedError:
                self.heart.fenced = self.heart.fenced or "fenced on join"
                continue
            self.generation, self.rank, self.world_size = formed.generation, formed.rank, formed.world_size
            self.local_rank = self.cfg.local_rank if self.cfg.local_rank is not None else formed.local_rank
            self.members = frozenset((m.node_id, m.incarnation) for m in formed.members)  # same set: nobody restarted
            try:
                self._build_group()
                if self.generation > 1:
                    self.announce()
                return formed
            except (RuntimeError, TrainguardError) as exc:
                failures.append(f"generation {self.generation}: {exc}")
                if len(failures) >= MAX_BUILD_FAILURES:
                    raise ClusterFailed(f"could not build a process group {len(failures)} times in a row; "
                                        f"last error: {failures[-1]}") from exc
                log.warning("building the group of generation %d failed (%s); regrouping", self.generation, exc)
                self.report_failure(str(exc))

    def _reregister(self) -> None:
        log.warning("this worker was fenced (%s); registering again", self.heart.fenced)
        self.heart.stop()
        self._register()

    def sever(self, reason: str) -> None:
        """Cut this generation's group connections: every collective with it fails at once, here and at
        the peers (also used to inject a failed collective in tests)."""
        self._sockets.sever(reason)

    def _on_news(self) -> None:
        """Heartbeat thread: the cluster left our generation. Cut our group's connections, so a collective blocked
        on a peer that went to regroup (alive, its sockets open) fails now, not after the collective timeout."""
        if self.membership_changed():
            why = f"the cluster moved past generation {self.generation}"
            self._sockets.sever(why)
            if self.backend == "nccl":
                self._abort_nccl(why)

    def _abort_nccl(self, why: str) -> None:
        """NCCL has a real abort: a survivor blocked in a collective with a dead peer is released at once
        instead of at the collective timeout (every communicator of the process, in one NCCL group)."""
        with self._abort_lock:
            if self.group is None or self._aborted == self.generation:
                return
            self._aborted = self.generation
            try:
                c10d._abort_process_group()
                log.info("aborted the NCCL communicators of generation %d (%s)", self.generation, why)
            except (RuntimeError, ValueError) as exc:
                log.warning("aborting the NCCL group of generation %d: %s", self.generation, exc)

    def track_group(self, before: dict[int, str], group) -> None:
        """A group made after the default one (a mesh's dimension, a side group, the script's `new_group`): its gloo
        sockets opened since `before` are cut with this generation's group; NCCL's are not ours to cut (aborted)."""
        if not isinstance(group, dist.ProcessGroup):  # this rank is not a member
            return
        self._groups.append(group)  # dropped with the generation (graveyard.py)
        if "gloo" in str(dist.get_backend(group)):
            self._sockets.add(GroupSockets.since(before, exclude_peers=scheduler_peers(*self.address)))
            self._on_news()

    def _backend(self) -> str:
        want = self.cfg.backend
        if want == "auto":
            want = "nccl" if torch.cuda.is_available() else "gloo"
        if want == "nccl":
            if not torch.cuda.is_available():
                raise ConfigError(f"{C.BACKEND_ENV}=nccl but CUDA is not available; use gloo")
            torch.cuda.set_device(self.local_rank % torch.cuda.device_count())
        self.backend = want
        return want

    def _build_group(self) -> None:
        self.drop_group()
        t0 = time.monotonic()
        timeout = timedelta(seconds=self.cfg.collective_timeout)
        # keep the Python store alive: C++ holds only its base, and the overrides vanish with it
        self._store = SchedulerStore(self.client, self.generation, timeout)
        store = dist.PrefixStore(generation_prefix(self.generation), self._store)
        backend = self._backend()
        kwargs = {}
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        before = open_sockets()
        _reset_group_names()
        ledger.reset(self.generation)  # every group's collectives are numbered from 1 again
        init = c10d.init_process_group  # torch's own, also where a script's call joins this group (pginit.py)
        getattr(init, "__wrapped__", init)(backend, store=store, rank=self.rank, world_size=self.world_size,
                                           timeout=timedelta(seconds=self.cfg.group_build_timeout), **kwargs)
        self.group = dist.group.WORLD
        _set_pg_timeout(timeout, self.group)  # built: collectives get the full collective timeout
        if backend == "gloo":
            self._sockets = GroupSockets.since(before, exclude_peers=scheduler_peers(*self.address))
            self._on_news()  # the generation may have moved on while we built this one
        log.info("generation %d: rank %d of %d, %s group built in %.0f ms (%d peer connections)", self.generation,
                 self.rank, self.world_size, backend, 1000 * (time.monotonic() - t0), len(self._sockets))

    def announce(self) -> None:
        """Say in the new generation's store that this rank formed it, and whether it stays in its step."""
        key = f"trainguard/in-step/g{self.generation}"
        if self.in_step:
            self._store.set(key, b"1")
        self._store.set(f"{key}/formed/{self.rank}", b"1")

    def peers_in_step(self) -> bool:
        """Whether a rank of this generation waits in its step; once every rank has said (`announce`)."""
        key = f"trainguard/in-step/g{self.generation}"
        self._store.wait([f"{key}/formed/{r}" for r in range(self.world_size)])
        return self._store.check([key])

    def drop_group(self) -> None:
        # peers still blocked in a collective with us learn at once that we left
        self._sockets.sever("leaving the group")
        if self.backend == "nccl" and self.group is not None:  # a hung communicator would block the destroy
            self._abort_nccl("leaving the group")
        if dist.is_initialized():  # the user's script may have destroyed it already: nothing to do then
            try:
                with collectives.internal():  # trainguard's teardown: not the script's (collectives.before_destroy)
                    dist.destroy_process_group()
            except (RuntimeError, ValueError, AssertionError) as exc:
                log.warning("dropping the broken group: %s", exc)
        graveyard.bury([self.group, *self._groups])  # never destroyed here: that may wait for stuck work
        self.group, self._groups = None, []

    def report_failure(self, detail: str, kind: p.FailureKind = p.FailureKind.COLLECTIVE) -> None:
        try:
            self.client.report_failure(self.generation, kind, detail, at=failed_at())
        except SchedulerUnavailable as exc:
            log.warning("could not report the failure (%s); the scheduler will learn it otherwise", exc)
        except ClusterFailed as exc:  # the job ended on a verdict about the script (a desync): the reply says which
            self.verdict = exc.verdict or 0

    def raised_everywhere(self, signature: str) -> str:
        """This rank's script raised an error with `signature`: why it is deterministic (every rank raised it at
        this step, or a rank raised it here before the job resumed here), or "". The group is cut first, so a
        peer blocked with us fails, regroups and fences this question ("") instead of waiting; ERROR_VOTE_S."""
        if self.finished or self.group is None or self.world_size < 2:  # alone, every error looks the same
            return ""
        self.drop_group()
        try:
            decision = self.client.agree(self.generation, "error",
                                         ErrorReport(signature=signature[:300], step=self.step), ERROR_VOTE_S)
        except (TrainguardError, OSError) as exc:
            log.info("rank %d: the error vote ended without a decision (%s)", self.rank, exc)
            return ""
        return decision.reason if isinstance(decision, ErrorDecision) and decision.same else ""

    def membership_changed(self) -> bool:
        """True when the scheduler has moved past our generation (seen by the heartbeat)."""
        return bool(self.heart.fenced) or self.heart.generation_seen > self.generation

    def broken(self) -> bool:
        """This generation is over for us: the cluster moved on, or one of its collectives failed."""
        return self.membership_changed() or collectives.failures.failed(self.generation) is not None

    def leave(self, reason: str) -> None:
        """Leave this generation for good (the script goes back to its committed step): cut and drop the
        group, tell the scheduler why, and join the next one at the next `init()`."""
        self.drop_group()
        self.events.emit("left_generation", generation=self.generation, rank=self.rank)
        if reason:
            self.report_failure(reason)
        self.rejoin = True

    # --- the end ---------------------------------------------------------------------------

    def finish(self, ok: bool = True, detail: str = "", *, stopped: bool = False,
               patience: float | None = None) -> None:
        """Say goodbye to the scheduler (once); `stopped`: a graceful exit, `patience`: seconds to wait for it."""
        if self.finished:
            return
        self.finished = True
        self.heart.leaving.set()
        try:
            if ok and not stopped and self.group is not None:  # the last collective done on every rank (store.py)
                leave_together(self._store, self.generation, self.rank, self.world_size, LEAVE_TOGETHER_S)
            self.client.finish(ok, detail, stopped=stopped, patience=patience)
        except (TrainguardError, OSError) as exc:
            log.warning("could not tell the scheduler this worker finished: %s", exc)
        self.heart.stop()
        self.drop_group()
        self.client.close()
        if self.scheduler is not None:  # rank 0 started the scheduler: it ends once the others have finished
            self.scheduler.wait(timeout=self.cfg.join_timeout)

    def record_error(self, text: str) -> None:
        self._error = text

    @property
    def failed(self) -> bool:
        """An exception is ending this process (recorded by the excepthook)."""
        return bool(self._error)

    def _at_exit(self) -> None:
        self.finish(ok=not self._error, detail=self._error)


def _reset_group_names() -> None:
    """Name the next default group as a fresh process would. torch names groups by a counter that
    a failed `init_process_group` leaves raised (and only `destroy_process_group` resets), so after a
    failed build this process would look for other rendezvous keys than its peers and all of them
    would wait for each other until the store timeout."""
    if not dist.is_initialized():
        c10d._world.group_count = 0


def init(env=None) -> Runtime:
    """Join the cluster described by the environment (TG_*/MS_* variables, or torchrun's or mpirun's).
    A scheduler-role process serves and exits here.

    What it changes in the process, all of it (documented, since a library should change nothing
    behind a script's back):
    - logging: `logging.basicConfig` at TG_LOG_LEVEL (default WARNING), a no-op if the script
      configured logging first;
    - OMP_NUM_THREADS=1 if unset, for the processes this one starts (DataLoader workers);
    - sys.excepthook is chained: an uncaught exception is sent to the scheduler as the job's root
      cause, then the previous hook runs;
    - an atexit handler says goodbye to the scheduler;
    - RANK, WORLD_SIZE and LOCAL_RANK are set to this generation's values, as torchrun sets them;
    - torch.distributed's collective functions are wrapped so that a failure comes out typed
      (`CollectiveFailed`, worker/collectives.py);
    - SIGUSR2 prints every thread's stack to stderr (faulthandler; worker/hang.py), where it would end it.
    Called again after a rewind (the script runs again in this process), it joins the next generation.
    Signal handlers (SIGTERM, SIGINT, SIGUSR1) come with the training wrappers, not with init()."""
    global _runtime
    if _runtime is not None:
        if _runtime.rejoin:  # the script runs again after a rewind: the next generation, before its collectives
            _runtime.rejoin = False
            _runtime.form()
            _export(_runtime)
        return _runtime
    refuse_a_rerun_by_multiprocessing()
    cfg = C.from_env(env)
    if cfg.role is C.Role.SCHEDULER:
        from ..control.sched_main import run_scheduler

        sys.exit(run_scheduler(cfg))
    logging.basicConfig(level=os.environ.get(C.LOG_LEVEL_ENV, "WARNING").upper(),
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dump_on_request()
    rt = Runtime(cfg)
    previous_hook = sys.excepthook

    def hook(tp, value, tb):
        rt.record_error("".join(traceback.format_exception(tp, value, tb))[-8000:])
        previous_hook(tp, value, tb)

    sys.excepthook = hook
    rewinding.set_error_vote(rt.raised_everywhere)
    atexit.register(rt._at_exit)
    collectives.install(lambda: joined().generation, rt.track_group)  # failures typed, every group's sockets cut
    prologue.install(rt); generators.install()  # the script's own collectives and generators (before its steps)
    rt.form()
    _runtime = rt
    _export(rt)
    return rt


def _export(rt: Runtime) -> None:
    """Scripts written for torchrun read these after init_process_group(): same names, this generation's values."""
    os.environ.update(RANK=str(rt.rank), WORLD_SIZE=str(rt.world_size), LOCAL_RANK=str(rt.local_rank))


def active() -> Runtime | None:
    """This process's runtime, or None before init()."""
    return _runtime


def current() -> Runtime:
    if _runtime is None:
        raise TrainguardError("trainguard.init() has not been called in this process")
    return _runtime


def joined() -> Runtime:
    """The runtime, in the current generation. A script run again after a rewind may not call init again (it checks
    `dist.is_initialized()` first, or a framework joined once for the process, as Accelerate's state does): it joins
    the next generation here, at its first collective, group or training step."""
    rt = current()
    return init() if rt.rejoin else rt


def get_rank() -> int:
    return current().rank


def get_world_size() -> int:
    return current().world_size


def get_local_rank() -> int:
    return current().local_rank


def get_group() -> dist.ProcessGroup:
    group = current().group
    assert group is not None
    return group
