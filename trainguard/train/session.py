"""The step loop with recovery points: `for step in session.steps(): with step: ...`.

Each step ends at a commit point. If anything failed during the step (a collective raised
inside `with step:`, the gradient hook recorded an error, or the scheduler moved to a new
generation), the session runs the recovery protocol instead of committing:

    drop the broken group -> join the next generation -> agree on the restore step ->
    restore (own snapshot / a peer / disk) -> rebuild DDP -> go on from that step.

Otherwise it commits: counters advance, a snapshot is taken (every `snapshot_every` steps)
and replicated, and callbacks run. The loop itself never changes for the user.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator

import torch.distributed as dist

from .. import runtime as rt_mod
from ..checkpoint.blob import pack, pack_flat, unpack
from ..checkpoint.codec import flatten_state, unflatten_state
from ..errors import ConfigError, FencedError, RecoveryError
from ..recovery.plan import lost_steps
from ..recovery.transfer import all_gather_bytes, recv_bytes, send_bytes
from .data import ShardedSampler
from .snapshots import Snapshot, SnapshotStore
from .state import TrainState, capture_rng, load_rng

log = logging.getLogger("trainguard.session")

_COLLECTIVE_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "timed out",
                       "timeout", "socket")


def is_collective_failure(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _COLLECTIVE_MARKERS)


@dataclass(kw_only=True, slots=True)
class SessionConfig:
    epochs: int = 1
    max_steps: int | None = None  # stop after this many steps in all (default: epochs x steps per epoch)
    snapshot_every: int = 1  # in-memory snapshot every k steps
    keep_snapshots: int = 2
    agree_timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ConfigError(f"epochs must be >= 1, got {self.epochs}")
        if self.max_steps is not None and self.max_steps < 0:
            raise ConfigError(f"max_steps must be >= 0, got {self.max_steps}")
        if self.snapshot_every < 1:
            raise ConfigError(f"snapshot_every must be >= 1, got {self.snapshot_every}")
        if self.keep_snapshots < 2:
            raise ConfigError("keep_snapshots must be >= 2 (ranks can be one step apart when a peer dies)")


class Step:
    """One training step. Use `with step:` around its body so a failed collective is caught."""

    __slots__ = ("session", "index", "epoch", "in_epoch", "batch", "failure")

    def __init__(self, session: "Session", index: int, epoch: int, in_epoch: int, batch):
        self.session, self.index, self.epoch, self.in_epoch, self.batch = session, index, epoch, in_epoch, batch
        self.failure: BaseException | None = None

    def __enter__(self) -> "Step":
        return self

    def __exit__(self, tp, exc, tb) -> bool:
        if exc is None:
            return False
        if is_collective_failure(exc) or self.session.rt.membership_changed():
            self.failure = exc
            return True
        return False


class Session:
    def __init__(self, state: TrainState, config: SessionConfig | None = None, *, runtime=None, checkpoint=None,
                 callbacks=()):
        self.state = state
        self.cfg = config or SessionConfig()
        self.rt = runtime or rt_mod.current()
        self.checkpoint = checkpoint  # a DiskCheckpointer (ModelCheckpoint) or None
        self.callbacks = list(callbacks)
        from ..testing.faults import FaultInjector, faults_from_env

        env_faults = faults_from_env()
        if env_faults:  # TG_FAULT: chaos-test any job without changing its code
            self.callbacks.append(FaultInjector(env_faults))
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
        self._sampler.set_position(self.in_epoch * self.state.loader.batch_size)
        return iter(self.state.loader)

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

    def steps(self) -> Iterator[Step]:
        self._recover(form=False, reason="")
        while True:
            if self.step >= self.total_steps:
                if self._finish():
                    return
                continue
            step = Step(self, self.step, self.epoch, self.in_epoch, self._next_batch())
            self.rt.step = self.step
            yield step
            failure = step.failure or (self._errors[0] if self._errors else None)
            if failure is None and self.rt.membership_changed():
                failure = RuntimeError(f"the cluster moved to generation {self.rt.heart.generation_seen}")
            if failure is None:
                try:
                    self._commit()
                    continue
                except RuntimeError as exc:
                    if not is_collective_failure(exc):
                        raise
                    failure = exc
            self._recover(form=True, reason=f"step {step.index}: {str(failure)[:300]}")

    def _commit(self) -> None:
        self.step += 1
        self.in_epoch += 1
        if self.steps_per_epoch and self.in_epoch >= self.steps_per_epoch:
            self.epoch, self.in_epoch, self._iter = self.epoch + 1, 0, None
        if self.step % self.cfg.snapshot_every == 0 or self.in_epoch == 0 or self.step == self.total_steps:
            self._snapshot()
        if self._pending_report is not None:
            took = time.monotonic() - self._pending_report
            self._pending_report = None
            self.rt.events.emit("step_finished", generation=self.rt.generation, step=self.step, rank=self.rt.rank,
                                recovery_s=round(took, 4))
        for cb in self.callbacks:
            cb.on_step_end(self)

    def _progress(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "in_epoch": self.in_epoch}

    def _snapshot(self) -> None:
        tensors, meta = flatten_state(self.state.capture_shared(), copy=True)
        own = pack({"rng": capture_rng(), "progress": self._progress()})
        snap = Snapshot(self.step, tensors, meta, own)
        self.snapshots.put(snap)
        blobs = all_gather_bytes(own, self.rt.group)
        snap.ranks = dict(enumerate(blobs))

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
        disk = self.checkpoint.complete_steps() if self.checkpoint is not None else []
        return {"memory": self.snapshots.report(), "disk": disk}

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
                    if reason and not reported:
                        rt.report_failure(reason)
                        reported = True
                    rt.form()
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
            loaded = self.checkpoint.load(s)
            self.state.load_shared(loaded["shared"])
            per = loaded["own"]
        if kind == "self":  # serve the ranks that take their state from us
            snap = self.snapshots.get(s)
            for q in sorted(int(r) for r, src in sources.items() if src.get("peer") == rt.rank):
                send_bytes(pack_flat(snap.tensors, snap.meta), q, rt.group)
                send_bytes(snap.ranks[q], q, rt.group)
        self.snapshots.drop_after(s)
        if hasattr(self.state.model, "rebuild"):
            self.state.model.rebuild(rt.group, self.record_error)
        progress = per["progress"] if per else {"step": 0, "epoch": 0, "in_epoch": 0}
        self.step, self.epoch, self.in_epoch = progress["step"], progress["epoch"], progress["in_epoch"]
        self._iter = None
        if self.state.loader is not None and self.in_epoch > 0:
            self._iter = self._make_iter()  # creating an iterator draws from the RNG: do it before restoring
        if per is not None:
            load_rng(per["rng"])
        self._snapshot()  # every rank holds (and has replicated) the restore step from here on
        rt.events.emit("restored", generation=rt.generation, rank=rt.rank, step=s, source=kind)
        if rt.rank == 0:
            rt.events.emit("restore_step", generation=rt.generation, to_step=s, from_step=decision.get("from_step"),
                           fresh=decision.get("fresh", False))
