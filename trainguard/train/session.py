"""The step loop with recovery points: `for step in session.steps(): with step: ...`.

Each step ends at a commit point. If anything failed during the step (a collective raised
inside `with step:`, the gradient hook recorded an error, or the scheduler moved to a new
generation), the session runs the recovery protocol instead of committing:

    drop the broken group -> join the next generation -> agree on the restore step ->
    restore (own snapshot / a peer / disk) -> rebuild DDP -> go on from that step.

Otherwise it commits: counters advance, a snapshot is taken (every `snapshot_every` steps)
and replicated, and callbacks run. The loop itself never changes for the user.

What a failed step leads to follows the recover strategy (recovery/strategies.py): a rollback
in process (retry, recover-in-place; at most `max_retries` in a row while nobody was restarted),
or a stop (exit, dump: train/graceful.py). A stop request (SIGTERM, SIGINT, SIGUSR1) rides on the
commit point's all-gather, so every rank stops at the same committed step.

Elastic (the world size changes between generations): the data position is global. Progress
also records the sampler's phase (`base`: where in the epoch's global order it began,
`phase_start`: the step in the epoch it began at, `shards`: its world size); a restore into
another world size starts a new phase at the first index not yet consumed (train/data.py), so
the rest of the epoch is split over the new world. The per-rank batch stays fixed, so the global
batch follows the world size and an epoch takes more steps in a smaller world; training ends
after `epochs` epochs (or `max_steps`). A returning node gets the shared state and the progress
from a peer, and its own RNG state if a snapshot holds one for its node id (else it keeps the
RNG its script seeded).
"""

from __future__ import annotations

import logging
import time
from typing import Iterator

from .. import runtime as rt_mod
from ..checkpoint.blob import pack, pack_flat, unpack
from ..checkpoint.codec import flatten_state, unflatten_state
from ..checkpoint.manager import DiskSources
from ..errors import ClusterFailed, ConfigError, FencedError, RecoveryError, Retriable
from ..recovery.plan import lost_steps
from ..recovery.transfer import all_gather_flagged, all_max, recv_bytes, send_bytes
from . import elastic, parallel_strategy
from .data import ShardedSampler
from .graceful import StopRequest, stop_gracefully, stop_on_fault
from .snapshots import Snapshot, SnapshotStore
from .state import TrainState, capture_rng, load_rng
from .step import SessionConfig, Step, is_collective_failure

__all__ = ["Session", "SessionConfig", "Step", "is_collective_failure"]

log = logging.getLogger("trainguard.session")


class Session:
    def __init__(self, state: TrainState, config: SessionConfig | None = None, *, runtime=None, checkpoint=None,
                 callbacks=()):
        self.state = state
        self.cfg = config or SessionConfig()
        self.rt = runtime or rt_mod.current()
        self.checkpoint = checkpoint  # a DiskCheckpointer (ModelCheckpoint) or None
        self.callbacks = list(callbacks)
        from ..testing.faults import FaultInjector, faults_from_env, slow_saves_from_env

        env_faults = faults_from_env()
        if env_faults:  # TG_FAULT: chaos-test any job without changing its code
            self.callbacks.append(FaultInjector(env_faults))
        slow_saves_from_env()
        self.snapshots = SnapshotStore(self.cfg.keep_snapshots)
        self.step = 0  # completed steps
        self.epoch = 0
        self.in_epoch = 0
        self.recoveries = 0
        self._errors: list[BaseException] = []
        self._iter = None
        self._sampler = self._find_sampler(state.loader)
        self._pending_report: float | None = None
        self.last_loss = None  # set by the training body (Model.train) for monitors
        self.last_step: Step | None = None
        self.strategy = self.rt.cfg.recover_strategy
        self.stop = StopRequest()
        self._retries = 0  # in-process rollbacks in a row with nobody restarted
        self._members: frozenset | None = None
        self.phase = elastic.Phase()  # the sampler's phase within the epoch (changes only under elastic)
        self._gen_nodes: tuple[str, ...] = ()  # node ids of this generation, by rank (from the restore agreement)
        self.disk_sources = DiskSources(checkpoint, *self.callbacks)
        self.gasp_savers = [c for c in self.disk_sources if c.saves_dying_gasp]
        if self.strategy.dump and not self.gasp_savers:
            raise ConfigError(f"the recover strategy {self.strategy} dumps a dying-gasp checkpoint on a fault, but "
                              "this session has nowhere to write it: add ModelCheckpoint(..., CheckpointConfig("
                              "exception_save=True)) or ExceptionCheckpoint(...) to its callbacks")

    # --- data -----------------------------------------------------------------------------

    @staticmethod
    def _find_sampler(loader) -> ShardedSampler | None:
        if loader is None:
            return None
        sampler = loader.sampler if isinstance(loader.sampler, ShardedSampler) else getattr(
            loader.batch_sampler, "sampler", None)
        if not isinstance(sampler, ShardedSampler):
            raise ConfigError("the loader's sampler must be trainguard.ShardedSampler so that the data position "
                              "can be restored after a failure: DataLoader(ds, batch_size=B, sampler=ShardedSampler(ds))")
        return sampler

    @property
    def steps_per_epoch(self) -> int | None:
        return len(self.state.loader) if self.state.loader is not None else None

    @property
    def total_steps(self) -> int:
        if self.cfg.max_steps is not None:
            return self.cfg.max_steps
        if self.steps_per_epoch is None:
            raise ConfigError("without a loader in TrainState, give SessionConfig(max_steps=...)")
        return self.cfg.epochs * self.steps_per_epoch

    def _make_iter(self):
        self._sampler.set_epoch(self.epoch)
        if self.strategy.elastic:  # this generation's sharding of the rest of the epoch
            self._sampler.set_phase(self.phase.base, self.rt.world_size, self.rt.rank)
        self._sampler.set_position((self.in_epoch - self.phase.start) * self.state.loader.batch_size)
        return iter(self.state.loader)

    def _done(self) -> bool:
        """Training is over: `max_steps` steps, or `epochs` epochs (elastic: an epoch's step count
        follows the world size)."""
        if self.strategy.elastic and self.cfg.max_steps is None and self.state.loader is not None:
            return self.epoch >= self.cfg.epochs
        return self.step >= self.total_steps

    def _next_batch(self):
        if self.state.loader is None:
            return None
        if self._iter is None:
            self._iter = self._make_iter()
        return next(self._iter)

    # --- the loop ---------------------------------------------------------------------------

    def record_error(self, exc: BaseException) -> None:
        """Called by the gradient hook: a collective failed during this step."""
        self._errors.append(exc)

    def is_retriable(self, exc: BaseException) -> bool:
        return self.strategy.retry and isinstance(exc, (Retriable, *self.cfg.retriable))

    def steps(self) -> Iterator[Step]:
        with self.stop.armed():  # SIGTERM/SIGINT/SIGUSR1 now ask for a graceful exit at a commit point
            self._recover(form=False, reason="")
            self._members = self.rt.members
            parallel_strategy.write_for(self)
            while True:
                if self._done():
                    if self._finish():
                        return
                    continue
                step = Step(self, self.step, self.epoch, self.in_epoch, self._next_batch())
                self.rt.step = self.step
                for cb in self.callbacks:
                    if hasattr(cb, "on_step_begin"):
                        cb.on_step_begin(self, step)
                yield step
                failure = step.failure or (self._errors[0] if self._errors else None)
                if failure is None and self.rt.membership_changed():
                    failure = RuntimeError(f"the cluster moved to generation {self.rt.heart.generation_seen}")
                if failure is None:
                    try:
                        stop = self._commit()
                    except RuntimeError as exc:
                        if not is_collective_failure(exc):
                            raise
                        failure = exc
                    else:
                        if stop and not self._done():  # after the last step: just finish
                            stop_gracefully(self, stop)
                        continue
                reason = f"step {step.index}: {type(failure).__name__}: {str(failure)[:300]}"
                if not self.strategy.rolls_back:
                    stop_on_fault(self, reason)
                self._recover(form=True, reason=reason)

    def _commit(self) -> int:
        """Commit the step; returns the stop vote (a signal number if any rank was asked to stop, else 0)."""
        self.step += 1
        self.in_epoch += 1
        self._retries = 0
        if self.steps_per_epoch and self.in_epoch - self.phase.start >= self.steps_per_epoch:
            self.epoch, self.in_epoch, self._iter = self.epoch + 1, 0, None
            self.phase = elastic.Phase(shards=self.rt.world_size)
        if self.step % self.cfg.snapshot_every == 0 or self.in_epoch == 0 or self._done():
            stop = self._snapshot()
        else:
            stop = all_max(self.stop.signum, self.rt.group)
        if self._pending_report is not None:
            took = time.monotonic() - self._pending_report
            self._pending_report = None
            self.rt.events.emit("step_finished", generation=self.rt.generation, step=self.step, rank=self.rt.rank,
                                recovery_s=round(took, 4))
        for cb in self.callbacks:
            cb.on_step_end(self)
        return stop

    def _progress(self) -> dict:
        progress = {"step": self.step, "epoch": self.epoch, "in_epoch": self.in_epoch}
        if self.strategy.elastic:
            progress.update(self.phase.as_dict(self.rt.world_size))
        return progress

    def _snapshot(self) -> int:
        """Snapshot and replicate this step (a collective); returns the stop vote that rode along."""
        tensors, meta = flatten_state(self.state.capture_shared(), copy=True)
        own = pack({"rng": capture_rng(), "progress": self._progress()})
        snap = Snapshot(self.step, tensors, meta, own, nodes=self._gen_nodes)
        self.snapshots.put(snap)
        blobs, stop = all_gather_flagged(own, self.stop.signum, self.rt.group)
        snap.ranks = dict(enumerate(blobs))
        return stop

    def _finish(self) -> bool:
        """The last barrier: everyone reached the end, or a late failure sends us back to recover."""
        try:
            self.rt.client.agree(self.rt.generation, "finish", {"step": self.step}, self.cfg.agree_timeout)
            return True
        except FencedError:
            self._recover(form=True, reason="")
            return False

    # --- recovery ---------------------------------------------------------------------------

    def _report(self) -> dict:
        return {"memory": self.snapshots.report(), "disk": self.disk_sources.complete_steps(),
                "node": self.rt.node_id}

    def _count_retry(self, reason: str) -> None:
        """A rollback with the same processes as before is a retry; past the limit, escalate."""
        same = self.rt.members == self._members
        self._members = self.rt.members
        self._retries = self._retries + 1 if same else 0
        if self._retries <= self.strategy.max_retries:
            return
        why = (f"step {self.step + 1} failed {self._retries} times in a row with every process alive (retry limit "
               f"{self.strategy.max_retries}, TG_MAX_RETRIES); last error: {reason}")
        if not self.strategy.restarts:
            stop_on_fault(self, why)
        raise RecoveryError(why + "; ending this process so that the launcher restarts it")

    def _recover(self, *, form: bool, reason: str) -> None:
        t0 = time.monotonic()
        rt = self.rt
        if form:
            self.recoveries += 1
            log.warning("rank %d: recovering (%s)", rt.rank, reason or "membership changed")
        reported = False
        while True:
            try:
                if form:
                    if hasattr(self.state.model, "drop"):
                        self.state.model.drop()
                    rt.drop_group()  # peers blocked in a collective with us fail now, not at its timeout
                    if reason and not reported:
                        rt.report_failure(reason)
                        reported = True
                    rt.form()
                    self._count_retry(reason or "membership changed")
                form = True
                t_agree = time.monotonic()
                decision = rt.client.agree(rt.generation, "restore", self._report(), self.cfg.agree_timeout)
                if decision.get("error"):
                    raise RecoveryError(decision["error"])
                t_apply = time.monotonic()
                self._apply(decision)
                log.info("rank %d: agreed on step %s in %.0f ms, restored in %.0f ms", rt.rank, decision["step"],
                         1000 * (t_apply - t_agree), 1000 * (time.monotonic() - t_apply))
                break
            except ClusterFailed as exc:  # the job is over (failed, or the launcher gave up): leave cleanly
                stop_on_fault(self, str(exc))
            except FencedError as exc:
                log.warning("rank %d: %s; regrouping", rt.rank, exc)
            except RuntimeError as exc:
                if not is_collective_failure(exc):
                    raise
                log.warning("rank %d: failure during recovery (%s); regrouping", rt.rank, str(exc)[:200])
        self._errors.clear()
        took = time.monotonic() - t0
        if self.recoveries:
            self._pending_report = t0
            if rt.rank == 0:
                print(f"trainguard: generation {rt.generation}: resumed at step {decision['step']} "
                      f"(lost {lost_steps(decision)} steps), regrouped and restored in {took:.3f} s", flush=True)

    def _apply(self, decision: dict) -> None:
        rt = self.rt
        s = int(decision["step"])
        sources = decision["sources"]
        mine = sources[str(rt.rank)]
        kind = mine["kind"]
        per = None
        if kind == "self":
            snap = self.snapshots.get(s)
            self.state.load_shared(unflatten_state(snap.tensors, snap.meta))
            per = unpack(snap.own)
        elif kind == "peer":
            self.state.load_shared(unpack(recv_bytes(mine["peer"], rt.group), "peer state"))
            per = unpack(recv_bytes(mine["peer"], rt.group), "peer rank state")
        elif kind == "disk":
            loaded = self.disk_sources.load(s)
            self.state.load_shared(loaded["shared"])
            per = loaded["own"]
        if kind == "self":  # serve the ranks that take their state from us
            snap = self.snapshots.get(s)
            for q in sorted(int(r) for r, src in sources.items() if src.get("peer") == rt.rank):
                send_bytes(pack_flat(snap.tensors, snap.meta), q, rt.group)
                if self.strategy.elastic:  # ranks may have moved: that node's own state, by node id
                    send_bytes(elastic.rank_blob(snap, decision.get("nodes", {}).get(str(q))), q, rt.group)
                else:
                    send_bytes(snap.ranks[q], q, rt.group)
        self.snapshots.drop_after(s)
        if hasattr(self.state.model, "rebuild"):
            self.state.model.rebuild(rt.group, self.record_error)
        progress = per["progress"] if per else {"step": 0, "epoch": 0, "in_epoch": 0}
        self.step, self.epoch, self.in_epoch = progress["step"], progress["epoch"], progress["in_epoch"]
        self._gen_nodes = elastic.generation_nodes(decision)
        self.phase = elastic.Phase.of(progress, rt.world_size)
        if self.strategy.elastic and self._sampler is not None:
            self.phase = elastic.reshard(self, self.phase)  # a new world size: split the rest of the epoch
        self._iter = None
        if self.state.loader is not None and self.in_epoch > 0:
            self._iter = self._make_iter()  # creating an iterator draws from the RNG: do it before restoring
        if per is not None and per.get("rng") is not None:  # none: a returning node keeps its own (elastic)
            load_rng(per["rng"])
        self._snapshot()  # every rank holds (and has replicated) the restore step from here on
        rt.events.emit("restored", generation=rt.generation, rank=rt.rank, step=s, source=kind)
        if rt.rank == 0:
            rt.events.emit("restore_step", generation=rt.generation, to_step=s, from_step=decision.get("from_step"),
                           fresh=decision.get("fresh", False))
