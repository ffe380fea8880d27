"""Keep your own loop: wrappers in the spirit of torchft's, on the same commit-or-skip core as Session.

    trainguard.init()
    model = trainguard.DDP(net)                                   # DistributedDataParallel(net)
    optimizer = trainguard.Optimizer(torch.optim.SGD(...))        # the commit point
    loader = trainguard.DataLoader(ds, batch_size=B, sampler=trainguard.DistributedSampler(ds))
    for epoch in range(trainguard.start_epoch(), epochs):         # where this process resumes
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()

- `start_epoch()` (or the first forward, batch or optimizer step) joins the job's state: fresh,
  from a peer (a replacement), or from disk (a rerun after a graceful stop).
- `optimizer.step()` applies the update only if the step's gradient exchange completed, counts the
  step, and otherwise recovers right there (the step is skipped: nothing was applied). After a
  skipped step the next batch is the same batch again; after catching up with a peer it is the
  peer's next one. A stop vote (SIGTERM) ends the process at the commit point, exit 75, after a
  dying-gasp checkpoint.
- A recovery that is only noticed after a committed step (the cluster moved on) waits for the next
  batch, so the user's code after `optimizer.step()` (an LR scheduler step, logging) has run.
- An LR scheduler given as `Optimizer(opt, lr_scheduler=s)` is restored with the rest, and its
  `step()` right after a skipped optimizer step does nothing.
- Dying-gasp checkpoints go to TG_CHECKPOINT_DIR, else `<recovery path>/checkpoints`; with neither,
  a graceful stop saves nothing and says that a rerun starts over.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from pathlib import Path

import torch

from ..errors import CollectiveFailed, ConfigError
from ..worker import runtime as rt_mod
from .checkpointing import CheckpointConfig, ExceptionCheckpoint
from .data import ShardedSampler
from .parallel import DataParallel
from .session import Session, SessionConfig
from .state import TrainState

log = logging.getLogger("trainguard.guard")
CHECKPOINT_DIR_ENV = "TG_CHECKPOINT_DIR"

_guard: "Guard | None" = None


class Guard:
    """The process's commit-or-skip core for a hand-written loop: a Session it drives step by step."""

    def __init__(self, optimizer: "Optimizer"):
        self.optimizer = optimizer
        self.session: Session | None = None
        self.loader: "DataLoader | None" = None
        self._armed = None
        self._skipped = False  # the last optimizer step was skipped: the scheduler's next step() must be too
        self._in_step = False

    # --- start --------------------------------------------------------------------------------

    def ensure_started(self) -> Session:
        if self.session is not None:
            return self.session
        opt = self.optimizer
        model = _model_of(opt.optimizer)
        state = TrainState(model=model, optimizer=opt.optimizer, scheduler=opt.lr_scheduler)
        rt = rt_mod.current()
        callbacks = []
        root = os.environ.get(CHECKPOINT_DIR_ENV) or (
            str(Path(rt.cfg.recovery_path) / "checkpoints") if rt.cfg.recovery_path is not None else "")
        if root:
            callbacks.append(ExceptionCheckpoint("job", root, CheckpointConfig(exception_save=True)))
        session = Session(state, SessionConfig(), runtime=rt, callbacks=callbacks)
        session.user_loop = True
        self.session = session
        if model is not None:
            model.on_forward = self.before_forward
        self._armed = session.stop.armed()
        self._armed.__enter__()  # SIGTERM/SIGINT/SIGUSR1: a graceful stop at the next commit point
        session.start()
        atexit.register(self._at_exit)
        return session

    def before_forward(self) -> None:
        if not self._in_step:
            self.begin_step()

    def attach_loader(self, loader: "DataLoader") -> None:
        session = self.ensure_started()
        if self.loader is not loader:
            self.loader = loader
            session.state.loader = loader
            session.sampler = loader.sampler

    def begin_step(self, batch=None) -> None:
        session = self.ensure_started()
        session.before_step()  # a recovery noticed after the last commit happens here
        session.begin_step(batch)
        self._in_step, self._skipped = True, False

    # --- the commit point ------------------------------------------------------------------------

    def step(self, closure=None):
        session = self.ensure_started()
        if not self._in_step:
            self.begin_step()
        self._in_step = False
        try:
            result = self.optimizer.optimizer.step(closure) if closure is not None else self.optimizer.optimizer.step()
        except CollectiveFailed as exc:
            self._skipped = True
            session.end_step(exc)
            return None
        session.end_step(None)
        return result

    def scheduler_may_step(self) -> bool:
        skip, self._skipped = self._skipped, False
        return not skip

    def _at_exit(self) -> None:
        """The last barrier, unless the script is failing: a peer that fails at the very end still gets
        its state from us."""
        session = self.session
        if session is None or session.rt.failed or session.rt.finished:
            return
        try:
            while not session.finish():
                pass
        except (SystemExit, Exception) as exc:  # leaving anyway; the scheduler learns it from the goodbye
            log.warning("rank %d: finishing: %s", session.rt.rank, exc)


def _model_of(optimizer: torch.optim.Optimizer) -> DataParallel | None:
    """The DataParallel wrapping the optimizer's parameters."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for dp in list(DataParallel.instances):
        if params & {id(p) for p in dp.module.parameters()}:
            return dp
    return None


def current() -> Guard:
    if _guard is None:
        raise ConfigError("no trainguard.Optimizer was created in this process: wrap the optimizer, "
                          "optimizer = trainguard.Optimizer(torch.optim.SGD(...)), before training")
    return _guard


# --- the wrappers ----------------------------------------------------------------------------


class Optimizer:
    """Wraps a torch optimizer: `step()` is the commit point (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, lr_scheduler=None):
        global _guard
        if isinstance(optimizer, Optimizer):
            raise ConfigError("this optimizer is wrapped twice in trainguard.Optimizer")
        if _guard is not None:
            raise ConfigError("trainguard.Optimizer supports one optimizer per process; combine parameter groups "
                              "into one optimizer")
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        _guard = self.guard = Guard(self)
        if lr_scheduler is not None:
            real = lr_scheduler.step

            def step(*args, **kwargs):  # after a skipped optimizer step the schedule must not move
                if self.guard.scheduler_may_step():
                    return real(*args, **kwargs)
                return None

            lr_scheduler.step = step

    def step(self, closure=None):
        return self.guard.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, group) -> None:
        self.optimizer.add_param_group(group)

    def __getattr__(self, name: str):  # anything else (defaults, hooks, ...) is the wrapped optimizer's
        if name in ("optimizer", "guard", "lr_scheduler"):  # not set yet (e.g. a copy under construction)
            raise AttributeError(name)
        return getattr(self.optimizer, name)


class DistributedSampler(ShardedSampler):
    """A drop-in for torch's DistributedSampler (num_replicas, rank, shuffle, seed, drop_last) that can
    resume mid-epoch; shards follow the current generation."""

    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False):
        super().__init__(dataset, num_shards=num_replicas, shard_id=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)


class DataLoader(torch.utils.data.DataLoader):
    """A drop-in for torch's DataLoader whose iterator follows the committed data position: after a
    skipped step it yields the same batch again, after catching up with a peer the peer's next one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, ShardedSampler):
            raise ConfigError("trainguard.DataLoader needs sampler=trainguard.DistributedSampler(dataset) so that "
                              "the data position can be restored after a failure")

    def __iter__(self):
        if _guard is None:  # not training under a guard (e.g. evaluation): a plain loader
            return super().__iter__()
        _guard.attach_loader(self)
        return _Batches(self, _guard)

    def plain_iter(self):
        return super().__iter__()


class _Batches:
    def __init__(self, loader: DataLoader, guard: Guard):
        self.loader, self.guard = loader, guard
        self.restores = guard.session.restores
        self.epoch = loader.sampler.epoch
        session = guard.session
        if self.epoch < session.epoch:
            raise ConfigError(f"this process resumed at epoch {session.epoch} (step {session.step}), but its loop "
                              f"is at epoch {self.epoch}: start the epoch loop at trainguard.start_epoch()")
        if self.epoch == session.epoch and session.in_epoch:
            loader.sampler.set_position(session.in_epoch * loader.batch_size)
        self.it = _quietly(loader.plain_iter)

    def __iter__(self):
        return self

    def __next__(self):
        guard, session = self.guard, self.guard.session
        session.before_step()
        if session.restores != self.restores:  # recovered: go on from the committed position
            self.restores = session.restores
            if session.epoch > self.epoch:
                raise StopIteration
            self.loader.sampler.set_position(session.in_epoch * self.loader.batch_size)
            self.it = _quietly(self.loader.plain_iter)
        batch = next(self.it)
        guard.begin_step(batch)
        return batch


def _quietly(make):
    """Build an iterator without moving torch's global random stream (the step's stream is seeded)."""
    state = torch.get_rng_state()
    try:
        return make()
    finally:
        torch.set_rng_state(state)


def start_epoch(default: int = 0) -> int:
    """The epoch this process's loop starts at: where the job is (a replacement, a rerun), else `default`.
    A `default` from the script's own resume code that disagrees is overridden, with a warning."""
    session = current().ensure_started()
    if not session.step:  # a fresh job: the script's own resume point (its weights were broadcast from rank 0)
        session.epoch = max(session.epoch, default)
        return session.epoch
    if default:  # the script's own resume code ran, and what it loaded was just replaced
        print(f"trainguard: rank {session.rt.rank}: trainguard's restore (step {session.step}: epoch {session.epoch}, "
              f"batch {session.in_epoch}, from {session.source}) overrides the script's own resume point (epoch "
              f"{default}). Remove the script's own snapshot loading, or keep it for runs without trainguard",
              file=sys.stderr, flush=True)
    return session.epoch
