"""The commit-or-skip core: `for step in session.steps(): with step: ...`, or driven by the wrappers
(train/engine/guard.py) from the user's own loop.

A step is *committed* on a rank when its optimizer update was applied, and the update is applied only when the
step's gradient exchange completed (the optimizer's step pre-hook raises `CollectiveFailed` otherwise). A failed
step therefore changes nothing: there is no half-applied update and no rollback copy. Ranks may end up one step
apart (an all-reduce can complete on some ranks and fail on others), and every rank that completed it holds the
correct next state. So recovery is:

    drop the broken group -> join the next generation -> agree on the newest committed step s
    -> ranks at s keep their state; the others (a rank one step behind, a replacement) receive
       it from a rank at s -> rebuild the gradient exchange for the new group -> go on.

No state is copied per step. Per-rank state is reduced to nothing: the data position follows from the committed step,
and the random streams of every rank are keyed at fixed points of each step by (job seed, rank, point)
(train/state/streams.py), so a rank's random stream at step s is known without having been saved. The job seed is
agreed at the first start (rank 0's `torch.initial_seed()`) and travels with the state, with the count of the last
committed step's training forwards.

The stop vote (SIGTERM, SIGINT, SIGUSR1) and the committed step ride in the exchange's control slots (lockstep.py).
What a failure leads to follows the recover strategy (strategies.py): recovery in process, or a stop (graceful.py).
Under elastic, progress also records the sampler's phase (train/data/phase.py), so a restore into another world size
splits the rest of the epoch over it.
"""

from __future__ import annotations

import logging
import time
from typing import Iterator

from ...checkpoint.blob import pack, unpack
from ...checkpoint.codec import flatten_state
from ...control.reports import FinishReport
from ...worker import runtime as rt_mod
from ...worker.transfer import all_max, all_max_each
from ..data import phase as elastic
from ..data.loaderseed import seed_loader_samples
from ..data.passes import Passes, pass_length
from ..data.sampler import sampler_of
from ...errors import CollectiveFailed, ConfigError, FencedError, Retriable, Rewind
from ..parallel.ddp import DataParallel
from ..parallel.livecopies import LiveCopies
from ..parallel.sharding import is_sharded, job_mesh
from ..state import parallel_strategy
from ..state.buffers import guard_for
from ..state.checkpointing import DiskSources
from ..state.shardckpt import ShardedSaver
from ..state.streams import Streams
from ..state.train_state import TrainState, bounded
from . import audit, lockstep, rewind
from .graceful import StopRequest, stop_gracefully, stop_on_fault
from .progress import ProgressEvents
from .recovery import Recovery
from .snapshots import Snapshot
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
        from .faults import env_callbacks

        self.callbacks += env_callbacks()  # TG_FAULT*: chaos-test any job without changing its code
        self.callbacks.append(ProgressEvents())  # the step rate in events.jsonl (trainguard report)
        self.injectors = [cb for cb in self.callbacks if hasattr(cb, "on_phase")]
        self.step = 0  # committed steps
        self.epoch = 0
        self.in_epoch = 0
        self.streams = Streams(self.rt)  # the keyed random streams; their seed is the job's, agreed at the first start
        self.holds_state = False  # False until this process started or restored: a fresh replacement
        self.recoveries = 0
        self.restores = 0  # completed restores (a data iterator made before one is out of date)
        self.source = ""  # where the last restore took this rank's state from
        self.user_loop = False  # driven from the user's own loop (guard.py): it decides the end, its epochs roll
        # when the training loader starts the next one, and a recovery noticed after a commit waits for the next step
        self.rewinds = False  # a fault sends the script back to its committed step (rewind.py), not recovering in place
        self.train_loader: int | None = None  # which of the script's loaders drives the steps (by creation order)
        self.passes = Passes()  # the training loader's passes: their labels, and the position at the last commit
        self._pending: str | None = None  # a recovery noticed after a commit, deferred to the next step
        self._stop_pending = 0  # a stop the job voted at a commit, deferred to the next step (the user's own loop)
        self._applied = False  # the optimizer applied this step's update
        self.iterator = None
        self.sampler = sampler_of(state.loader)
        self.first_step_since: float | None = None  # a recovery's start, until its first step (an event)
        self.last_loss = None  # set by the training body (Model.train) for monitors
        self.last_step: Step | None = None
        self.strategy = self.rt.cfg.recover_strategy
        self.stop = StopRequest()
        self.recovery = Recovery(self)
        self.phase = elastic.Phase()  # the sampler's phase within the epoch (changes only under elastic)
        self.disk_sources = DiskSources(checkpoint, *self.callbacks)
        self.gasp_savers = [c for c in self.disk_sources if c.saves_dying_gasp]
        if self.strategy.dump and not any(not c.collective for c in self.gasp_savers):
            raise ConfigError(f"the recover strategy {self.strategy} dumps a dying-gasp checkpoint on a fault, but "
                              "this session has nowhere to write it: add ModelCheckpoint(..., CheckpointConfig("
                              "exception_save=True)) or ExceptionCheckpoint(...) to its callbacks")
        self.sync = state.model.sync if isinstance(state.model, DataParallel) else None
        state.sharded = state.sharded or is_sharded(state.model)
        self.live = LiveCopies(self) if state.sharded else None  # ranks hold parts: copies, shard map
        if self.live is not None and (state.optimizer is None or self.strategy.elastic):
            raise ConfigError("a sharded model (FSDP2, HSDP, DP x TP) needs its optimizer in the state and a fixed "
                              "world size (elastic cannot re-lay its shards): use --recover-strategy recover-in-place, "
                              "or shrink exactly with trainguard.DDP and --virtual-shards")
        self.buffers = guard_for(state.model, state.sharded)  # put back after a step cut short or skipped
        if self.sync is not None:
            self.sync.control = lambda: lockstep.control(self.stop.signum, self.step)  # ride in the exchange
            self.sync.after_launch = lambda: self.phase_point("in_exchange")
        if state.optimizer is not None:
            self._hooks = [state.optimizer.register_step_pre_hook(self._before_update),
                           state.optimizer.register_step_post_hook(self._after_update)]

    # --- data -----------------------------------------------------------------------------

    @property
    def steps_per_epoch(self) -> int | None:
        return pass_length(self.state.loader) if self.state.loader is not None else None

    @property
    def total_steps(self) -> int:
        if self.cfg.max_steps is not None:
            return self.cfg.max_steps
        if self.steps_per_epoch is None:
            raise ConfigError("without a loader in TrainState, give SessionConfig(max_steps=...)")
        return self.cfg.epochs * self.steps_per_epoch

    def make_iter(self):
        """A data iterator at the committed position (epoch, in_epoch, phase)."""
        self.sampler.set_epoch(self.epoch)
        if self.strategy.elastic:  # this generation's sharding of the rest of the epoch
            self.sampler.set_phase(self.phase.base, self.rt.world_size, self.rt.rank)
        self.sampler.set_position((self.in_epoch - self.phase.start) * self.state.loader.batch_size)
        seed_loader_samples(self.state.loader, self.sampler, self.streams.seed)  # random draws in loader workers
        return iter(self.state.loader)

    def done(self) -> bool:
        """Training is over: `max_steps` steps, or `epochs` epochs (elastic: an epoch's steps follow the world)."""
        if self.user_loop:
            return False
        if self.strategy.elastic and self.cfg.max_steps is None and self.state.loader is not None:
            return self.epoch >= self.cfg.epochs
        return self.step >= self.total_steps

    def _next_batch(self):
        self.streams.step_begins(self.step)  # before the batch is drawn: a loader's randomness is part of the step
        if self.state.loader is None:
            return None
        if self.iterator is None:
            self.iterator = self.make_iter()
        return next(self.iterator)

    # --- the loop ---------------------------------------------------------------------------

    def is_retriable(self, exc: BaseException) -> bool:
        return self.strategy.retry and isinstance(exc, (Retriable, *self.cfg.retriable))

    def phase_point(self, name: str) -> None:
        """Fault injection points inside a step (testing.faults): before/in/after the exchange, in the commit."""
        for cb in self.injectors:
            cb.on_phase(self, name)

    def _before_update(self, _opt, _args, _kwargs) -> None:
        if self.live is not None:
            self.live.before_update()
        self.phase_point("after_exchange")
        if self.sync is not None:
            self.sync.result()  # raises CollectiveFailed: the update is not applied
            lockstep.check(self, self.sync.controls)  # ranks that made other updates: the job ends

    def _after_update(self, _opt, _args, _kwargs) -> None:
        self._applied = True
        self.phase_point("in_commit")

    def start(self) -> None:
        """Join the job's state: fresh, from a peer, or from disk (every rank together). After a rewind this
        process's committed state, kept from the script's last run, is this rank's live state."""
        if self.live is not None and not self.rewinds:
            raise ConfigError("a sharded model recovers by running the script again from its committed step: drive "
                              "it from your own loop with trainguard.Optimizer, started by `trainguard run` (the "
                              "Session API and hand or torchrun launches recover in place, which a sharded model "
                              "cannot)")
        kept = rewind.take_kept()
        if kept is not None:
            self.adopt(kept)
        rewind.track(self)
        self._recover(form=False, reason="")
        self.recovery.members = self.rt.members
        parallel_strategy.write_for(self, job_mesh())
        if self.step and (self.rt.rank == 0 or (self.rt.generation > 1 and not rewind.rewound())):  # a rerun, a
            who = "" if self.rt.rank == 0 else f"rank {self.rt.rank}: "  # replacement (its peers may stay: instep.py)
            print(f"trainguard: {who}resumed at step {self.step} (epoch {self.epoch}, batch {self.in_epoch}) "
                  f"from {self.source}", flush=True)
            if self.done():
                print(f"trainguard: the training is already complete at step {self.step} ({self.cfg.epochs} "
                      "epochs): nothing left to train. Raise the epochs, or remove the checkpoints to start over",
                      flush=True)

    def steps(self) -> Iterator[Step]:
        with self.stop.armed():  # SIGTERM/SIGINT/SIGUSR1 now ask for a graceful exit at a commit point
            self.start()
            while True:
                if self.done():
                    if self.finish():
                        return
                    continue
                step = self.begin_step(self._next_batch())
                yield step
                self.end_step(step.failure)

    def before_step(self) -> None:
        """Run a stop or a recovery deferred from the last commit (hand-written loops)."""
        if self._stop_pending:
            stop_gracefully(self, self._stop_pending)
        if self._pending is not None:
            reason, self._pending = self._pending, None
            if self.rewinds:
                raise Rewind(reason or "the cluster moved on")
            self._recover(form=True, reason=reason)

    def take_pending(self) -> str | None:
        """The recovery deferred from the last commit, if any, taken (instep.py carries it out in place)."""
        reason, self._pending = self._pending, None
        return reason

    def begin_step(self, batch=None) -> Step:
        step = Step(self.is_retriable, self.step, self.epoch, self.in_epoch, batch)
        self._applied, self.rt.step = False, self.step
        self.passes.begin_step(self.state)  # what the body moves before the update runs again after a fault in it
        for cb in self.callbacks:
            if hasattr(cb, "on_step_begin"):
                cb.on_step_begin(self, step)
        self.phase_point("before_exchange")
        if self.live is not None:
            self.live.begin_step()
        return step

    def end_step(self, failure: BaseException | None, batches: int = 1, ahead: int = 0) -> None:
        """The commit point: commit (if the update was applied, or there is none to apply) or skip, then
        recover if anything failed or the cluster moved on. `batches`: the training batches the step took
        (more than one with gradient accumulation); `ahead`: one it took for the next step (batches.py)."""
        if failure is None or self._applied:
            self._advance(batches, ahead)
            if self.buffers is not None:
                self.buffers.commit()
        else:
            self.streams.skipped()
            if self.buffers is not None:  # the skipped step's forward moved them: back to the committed values
                self.buffers.rollback()
        if failure is None:
            try:
                stop = self._after_commit()
            except CollectiveFailed as exc:
                failure = exc
            else:
                if stop and self.user_loop:  # the script's code after optimizer.step() (its scheduler.step())
                    self._stop_pending = stop  # belongs to the step: stop where the next one begins
                elif stop and not self.done():  # after the last step: just finish
                    stop_gracefully(self, stop)
                if self.rt.membership_changed():
                    self._recover_after(committed=True, reason="")
                return
        reason = f"step {self.step}: {type(failure).__name__}: {str(failure)[:300]}"
        if not self.strategy.rolls_back:
            stop_on_fault(self, reason)
        self._recover_after(committed=self._applied, reason=reason)

    def _recover_after(self, *, committed: bool, reason: str) -> None:
        if committed and self.user_loop:  # let the user's code after optimizer.step() run first
            self._pending = reason
        elif self.rewinds:
            raise Rewind(reason or "the cluster moved on")
        else:
            self._recover(form=True, reason=reason)

    def _advance(self, batches: int = 1, ahead: int = 0) -> None:
        """This rank's state is now at the next step: count it (and key the streams, where the step had no training
        forward the guard saw: streams.py). In the user's own loop the epoch rolls only when the training loader
        starts the next one (`roll_epoch`): until then the job is at its epoch's end, before the code after it."""
        self.step += 1
        self.in_epoch += batches
        if not self.user_loop and self.steps_per_epoch and self.in_epoch - self.phase.start >= self.steps_per_epoch:
            self.roll_epoch(self.epoch + 1)
        self.streams.committed(self.step)
        self.passes.commit(self.epoch, self.in_epoch, self.state, ahead)

    def roll_epoch(self, epoch: int) -> None:
        self.epoch, self.in_epoch, self.iterator = epoch, 0, None
        self.passes.roll()
        self.phase = elastic.Phase(shards=self.rt.world_size)

    def _after_commit(self) -> int:
        """Events and callbacks of a committed step; returns the stop vote (a signal number or 0)."""
        self.recovery.retries = 0
        sync = self.sync
        if self.live is not None:  # the stop vote and the snapshot cadence, in one all-reduce
            stop, every = all_max_each([self.stop.signum, self.live.proposal()], self.rt.group)
            self.live.after_commit(every)
        elif sync is not None and sync.controls_fresh():
            stop = lockstep.stop_vote(sync.controls)
        else:  # no gradient exchange this step carried the vote
            stop = all_max(self.stop.signum, self.rt.group)
        if self.first_step_since is not None:
            took = time.monotonic() - self.first_step_since
            self.first_step_since = None
            self.rt.events.emit("step_finished", generation=self.rt.generation, step=self.step, rank=self.rt.rank,
                                recovery_s=round(took, 4))
        for cb in self.callbacks:
            cb.on_step_end(self)
        return stop

    def progress(self) -> dict:
        epoch, in_epoch, _ = self.passes.committed
        progress = {"step": self.step, "epoch": epoch, "in_epoch": in_epoch}
        if self.strategy.elastic:
            progress.update(self.phase.as_dict(self.rt.world_size))
        return progress

    def capture(self) -> Snapshot:
        """A private copy of the committed state, for a checkpoint (the copy is all an async save blocks on).
        Data-parallel ranks hold the same state and progress, so every rank's part is the same."""
        tensors, meta = flatten_state(self.state.capture_shared(self.passes.held), copy=True)
        own = pack(self.own())
        return Snapshot(self.step, tensors, meta, own, ranks=dict.fromkeys(range(self.rt.world_size), own))

    def own(self) -> dict:
        """What a peer or a checkpoint needs besides the objects' states: the position, the job's seed, and
        which of the script's loaders drives the steps."""
        own = {"progress": self.progress(), "seed": self.streams.seed, "forwards": self.streams.committed_forwards,
               "ahead": self.passes.ahead, "verified": audit.verified()}
        if self.passes.committed[2] is not None:
            own["label"] = self.passes.committed[2]
        if self.train_loader is not None:
            own["loader"] = self.train_loader
        return own

    def pack_live(self) -> bytes:
        """This rank's committed state, as sent to a peer (and kept across a rewind)."""
        return pack({"shared": self.state.capture_shared(self.passes.held), "own": self.own()})

    def flat_live(self) -> tuple[dict, dict]:
        """`pack_live`'s content flattened, its tensors the live ones (an in-memory copy clones them)."""
        return flatten_state({"shared": self.state.capture_shared(self.passes.held), "own": self.own()}, copy=False)

    def take_blob(self, blob: bytes, what: str) -> None:
        """Load a committed state packed by `pack_live` (a peer's, a kept one, an in-memory copy)."""
        state = unpack(blob, what)
        self.state.load_shared(state["shared"])
        self.take_progress(state["own"])
        if self.buffers is not None:
            self.buffers.refresh()

    def adopt(self, blob: bytes) -> None:
        """Take a committed state kept from this process's previous run of the script (a rewind): the new
        objects hold it before the job agrees, and this rank reports it as its live state."""
        self.take_blob(blob, "kept state")
        self.holds_state = True

    def flush_saves(self) -> None:
        """The user's own loop ended: write a checkpoint its last commit left due (collective)."""
        for src in self.disk_sources:
            if isinstance(src, ShardedSaver):
                src.flush(self)

    def _recover(self, *, form: bool, reason: str) -> None:
        self.recovery.run(form=form, reason=reason)

    def finish(self, recover: bool = True) -> bool:
        """The last barrier: everyone reached the end, or a late failure sends us back to recover (in place,
        or, with `recover=False`, to the caller: a rewind)."""
        try:
            self.rt.client.agree(self.rt.generation, "finish", FinishReport(step=self.step), self.cfg.agree_timeout)
            return True
        except FencedError:
            if recover:
                self._recover(form=True, reason="")
            return False

    def take_progress(self, own: dict) -> None:
        progress = own["progress"]
        self.step, self.epoch, self.in_epoch = progress["step"], progress["epoch"], progress["in_epoch"]
        self.rt.step = self.step  # every rank at the same step now (a replacement too: the error vote compares it)
        if own.get("loader") is not None:
            self.train_loader = int(own["loader"])
        self.phase = elastic.Phase.of(progress, self.rt.world_size)
        if own.get("seed") is not None:
            self.streams.seed = int(own["seed"])
        elif self.streams.seed is None:  # a checkpoint from before seeds were saved
            self.streams.seed = 0
        self.streams.committed_forwards = bounded(own, "forwards", 1 << 31, 0)  # before it travelled: 0
        self.passes.restore(bounded(own, "label", 1 << 63, None))
        self.passes.commit(self.epoch, self.in_epoch, ahead=bounded(own, "ahead", 3, 0))  # before it travelled: 0
