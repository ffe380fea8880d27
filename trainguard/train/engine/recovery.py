"""Recovery in place: leave the broken generation, join the next, agree on the restore step, take it.

`Recovery` is the session's collaborator for the part of the protocol that runs between two steps
(see docs/ARCHITECTURE.md, "The path of a recovery"): each rank reports what it holds
(`report`), the scheduler decides (control/restore_plan.py), and `apply` carries the decision out:
ranks at the step keep their state, the others receive it from a holder (or load it from disk, or
start fresh), holders send it, and the session's position, seed and gradient exchange follow. It
counts retries (a recovery with the same processes as before) and escalates past the limit.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from ...checkpoint.blob import unpack
from ...control.outcomes import RestoreDecision, SourceKind
from ...control.reports import RestoreReport, ShardedRestoreReport
from ...errors import ClusterFailed, CollectiveFailed, ConfigError, FencedError, RecoveryError, Rewind
from ...worker.transfer import broadcast_int, recv_bytes, send_bytes
from ..data import phase as elastic
from ..state.train_state import TrainState, job_seed
from . import alike, audit
from .graceful import stop_on_fault

log = logging.getLogger("trainguard.session")


class Recovering(Protocol):
    """What a recovery reads and sets of its session (train/engine/session.py's Session)."""

    rt: Any  # the worker runtime (worker/runtime.py)
    cfg: Any  # SessionConfig
    strategy: Any  # the recover strategy (strategies.py)
    state: TrainState
    live: Any  # LiveCopies for a sharded model, else None
    sync: Any  # the data-parallel gradient exchange, else None
    buffers: Any  # the buffers' guard, else None
    disk_sources: Any  # DiskSources
    sampler: Any
    phase: elastic.Phase
    step: int
    epoch: int
    in_epoch: int
    holds_state: bool
    recoveries: int
    restores: int
    source: str
    user_loop: bool
    rewinds: bool  # a failure goes back to the committed step by running the script again (train/engine/rewind.py)
    streams: Any  # the keyed random streams and the job's seed (train/state/streams.py)
    passes: Any  # the training loader's passes and the committed position (train/data/passes.py)
    iterator: Any
    first_step_since: float | None

    def pack_live(self) -> bytes: ...

    def take_progress(self, own: dict) -> None: ...

    def make_iter(self) -> Any: ...


class Recovery:
    def __init__(self, session: Recovering):
        self.session = session
        self.retries = 0  # in-process recoveries in a row with nobody restarted
        self.members: frozenset | None = None  # the processes of the last recovery

    def report(self) -> RestoreReport:
        session = self.session
        step = session.step if session.holds_state else None
        disk = session.disk_sources.complete_steps()
        if session.live is not None:  # a sharded model: which shard this rank holds, and the copies it keeps
            return ShardedRestoreReport(step=step, shard=session.live.shard(), memory=session.live.copies.held(),
                                        disk=disk, node=session.rt.node_id)
        return RestoreReport(step=step, disk=disk, node=session.rt.node_id)

    def count_retry(self, reason: str) -> None:
        """A recovery with the same processes as before is a retry; past the limit, escalate."""
        session = self.session
        same = session.rt.members == self.members
        self.members = session.rt.members
        self.retries = self.retries + 1 if same else 0
        if self.retries <= session.strategy.max_retries:
            return
        why = (f"step {session.step + 1} failed {self.retries} times in a row with every process alive (retry limit "
               f"{session.strategy.max_retries}, TG_MAX_RETRIES); last error: {reason}")
        if not session.strategy.restarts:
            stop_on_fault(session, why)
        raise RecoveryError(why + "; ending this process so that the launcher restarts it")

    def run(self, *, form: bool, reason: str, in_step: bool = False) -> bool:
        """Regroup (`form`), agree on the restore step and take it. `in_step`: this rank's gradient exchange failed and
        it waits in its step (instep.py); True if it holds the agreed step and so stays there."""
        session = self.session
        t0 = time.monotonic()
        rt = session.rt
        if form:
            session.recoveries += 1
            log.warning("rank %d: recovering (%s)", rt.rank, reason or "membership changed")
        reported = False
        while True:
            try:
                if form:
                    if session.sync is not None:
                        session.state.model.drop()
                    rt.drop_group()  # peers blocked in a collective with us fail now, not at its timeout
                    rt.events.emit("left_generation", generation=rt.generation, rank=rt.rank)
                    if reason and not reported:
                        rt.report_failure(reason)
                        reported = True
                    rt.form()
                    self.count_retry(reason or "membership changed")
                form = True
                if session.live is not None:
                    session.live.attach()  # this generation's shard map and copy exchange (collective)
                t_agree = time.monotonic()
                decision = rt.client.agree(rt.generation, "restore", self.report(), session.cfg.agree_timeout)
                if decision.error is not None:  # no state to go on from: a restart would not bring it back
                    stop_on_fault(session, f"the job cannot be restored: {decision.error}")
                t_apply = time.monotonic()
                stays = self.apply(decision, in_step=in_step)
                log.info("rank %d: agreed on step %s in %.0f ms, restored in %.0f ms", rt.rank, decision.step,
                         1000 * (t_apply - t_agree), 1000 * (time.monotonic() - t_apply))
                break
            except ClusterFailed as exc:  # the job is over (failed, or the launcher gave up): leave cleanly
                stop_on_fault(session, str(exc), verdict=exc.verdict)
            except (FencedError, CollectiveFailed) as exc:
                if session.rewinds:  # every rank, the replacement too, goes through the script's setup again (its
                    # mesh's groups, its own collectives): a rank that regrouped here would call other collectives
                    raise Rewind(f"failure during recovery: {type(exc).__name__}: {str(exc)[:200]}") from exc
                log.warning("rank %d: failure during recovery (%s); regrouping", rt.rank, str(exc)[:200])
        took = time.monotonic() - t0
        if session.recoveries or rt.generation > 1:  # a replacement reports its first step too (trainguard report)
            session.first_step_since = t0
        if session.recoveries and rt.rank == 0:
            print(f"trainguard: generation {rt.generation}: resumed at step {decision.step} "
                  f"(lost {decision.lost_steps} steps), regrouped and restored in {took:.3f} s", flush=True)
        return stays

    def apply(self, decision: RestoreDecision, *, in_step: bool = False) -> bool:
        """Carry the decision out; True if this rank `in_step` holds the agreed step and goes on inside its step: its
        position, streams and loaders stay where the step has them (instep.py)."""
        session = self.session
        rt = session.rt
        s = decision.step
        mine = decision.source(rt.rank)
        kind = mine.kind
        stays = in_step and kind is SourceKind.SELF
        taken, folder = None, None
        live = session.live
        received = live.transfer(decision) if live is not None else None  # sharded: every pair, in one order
        if kind is SourceKind.PEER:
            taken = unpack(received if live is not None else recv_bytes(mine.peer, rt.group), "peer state")
            if taken["own"].get("verified") is True:  # the job was seen to resume exactly (instep.py)
                audit.trust()
        elif kind is SourceKind.MEMORY:  # sharded: this rank's own copy of an earlier step
            taken = unpack(live.own_copy(s), f"the in-memory copy of step {s}")
        elif kind is SourceKind.DISK:
            taken, folder = session.disk_sources.load(s)
        elif kind is SourceKind.INIT:  # a fresh job: everyone starts from rank 0's parameters and seed
            if session.sync is not None:
                session.state.model.broadcast_from(0, rt.group)
            session.streams.seed = broadcast_int(job_seed(), 0, rt.group)
            for line in alike.check(session.state.extra, rt.group):
                if rt.rank == 0:
                    log.warning(line)
        serve = decision.served_by(rt.rank) if live is None else []
        if serve:
            blob = session.pack_live()
            for q in serve:
                send_bytes(blob, q, rt.group)
        if taken is not None:
            session.state.load_shared(taken["shared"])
            session.take_progress(taken["own"])
        elif not session.phase.shards:  # a fresh start: the phase of this world
            session.phase = elastic.Phase.of({}, rt.world_size)
        if session.sync is not None:
            session.state.model.rebuild(rt.group, rt.cfg.virtual_shards)
        elif rt.cfg.virtual_shards:
            raise ConfigError(f"--virtual-shards {rt.cfg.virtual_shards} needs the model wrapped in trainguard.DDP, "
                              f"whose exchange adds the shards exactly; this job's model is a "
                              f"{type(session.state.model).__name__} (sharded models and torch's DDP are not covered): "
                              "wrap it in trainguard.DDP, or leave --virtual-shards out")
        if session.buffers is not None:
            session.buffers.refresh()
        session.holds_state = True
        if not stays:  # a rank staying in its step is where the step has it: position, streams, loaders
            self.resume_position()
            session.source = f"{mine.words()} ({folder})" if kind is SourceKind.DISK else mine.words()
        if live is not None:
            live.restored()  # every rank copies the step it now holds
        rt.events.emit("restored", generation=rt.generation, rank=rt.rank, step=s, source=kind.value, peer=mine.peer,
                       copy=None if mine.origin is None else mine.origin.value, in_step=stays)
        if rt.rank == 0:
            rt.events.emit("restore_step", generation=rt.generation, to_step=s, from_step=decision.from_step,
                           fresh=decision.fresh)
        return stays

    def resume_position(self) -> None:
        """The loaders and streams go on from the restored position (the loop's next batch, the next step's seeds)."""
        session = self.session
        session.restores += 1
        if session.strategy.elastic and session.sampler is not None and not session.sampler.virtual:
            # a new world size: split the rest of the epoch
            session.phase, session.epoch, session.in_epoch = elastic.reshard(
                session.phase, rt=session.rt, sampler=session.sampler, loader=session.state.loader,
                epoch=session.epoch, in_epoch=session.in_epoch)
            session.passes.commit(session.epoch, session.in_epoch)
        session.iterator = None
        if session.state.loader is not None and session.in_epoch > 0 and not session.user_loop:
            session.iterator = session.make_iter()  # creating an iterator draws from the RNG: do it before seeding
        session.streams.restored(session.step)
        # the streams are now where the last training forward of step s left them in a run without a fault: what the
        # script draws from here to its next step (a prefetched batch, an eval on one rank) comes out the same
