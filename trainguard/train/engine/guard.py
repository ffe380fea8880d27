"""Keep your own loop: wrappers in the spirit of torchft's, on the same commit-or-skip core as Session.

    trainguard.init()
    model = trainguard.DDP(net)                                   # DistributedDataParallel(net)
    optimizer = trainguard.Optimizer(torch.optim.SGD(...), lr_scheduler=sched)  # the commit point
    loader = trainguard.DataLoader(ds, batch_size=B, sampler=trainguard.DistributedSampler(ds))
    for epoch in range(trainguard.start_epoch(), epochs):         # where this process resumes
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step(); sched.step()
        evaluate(model, eval_loader)                              # any loader, collectives, barriers

- `start_epoch()` (or the first forward, batch or optimizer step) joins the job's state: fresh, from a peer (a
  replacement), or from disk (a rerun after a graceful stop).
- `optimizer.step()` applies the update only if the step's exchange completed, and counts it (with BatchNorm's updates).
- State: model, optimizer, the LR scheduler given here, and any object with `state_dict()` /
  `load_state_dict()` registered with `register_state` (a GradScaler, a second scheduler). They are
  held, never patched: their `state_dict()` still pickles. Schedulers on the optimizer, GradScalers
  and AveragedModels the script did not give are found and restored too (train/state/discover.py).
- A fault anywhere (in a step, in an eval pass, in a barrier, in the script's own save) sends every
  rank back to the committed step: under `trainguard run` the script runs again from the top in the
  same process, its objects refilled with the committed state (train/engine/rewind.py), so every rank,
  the replacement included, goes through the same collectives from there. Started by hand (no
  `trainguard run`), a failed step recovers in place and a fault outside a step ends the process.
- A stop vote (SIGTERM) ends the process at the commit point, exit 75, after a dying-gasp checkpoint
  into TG_CHECKPOINT_DIR, else `<recovery path>/checkpoints`.
- `checkpoints=trainguard.ShardedCheckpoints(directory, prefix, every=N)`: sliced checkpoints every N steps and at a
  stop, which the job restores from when no live copy is left, and which resume on another layout (shardckpt.py).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import weakref
from pathlib import Path

import torch

from ... import rewinding
from ...config import CHECKPOINT_DIR_ENV
from ...errors import CollectiveFailed, ConfigError, Rewind
from ...worker import collectives, prologue, runtime as rt_mod
from ...worker.ledger import ledger
from ..data import plainloaders
from ..parallel import sharding
from ..parallel.ddp import DataParallel
from ..state import discover
from ..state.checkpointing import CheckpointConfig, ExceptionCheckpoint
from ..state.shardckpt import ShardedSaver
from ..state.train_state import TrainState
from . import audit, holds, instep, pastend, plainvars, tail, unheld, rewind as rewind_mod
from .audit import Audit
from .batches import StepBatches
from .callbacks import Callback
from .session import Session, SessionConfig

log = logging.getLogger("trainguard.guard")

_guard: "Guard | None" = None
_pending_state: dict[str, object] = {}  # register_state before the optimizer was wrapped


class Guard:
    """The process's commit-or-skip core for a hand-written loop: a Session it drives step by step."""

    def __init__(self, optimizer):  # a trainguard.Optimizer (optimizer.py)
        self.optimizer = optimizer
        self.session: Session | None = None
        self.model: torch.nn.Module | None = None  # a DataParallel, or a sharded model (train/parallel/sharding.py)
        self.stateful: dict[str, object] = dict(_pending_state)
        self._armed, self._hooks = None, []  # the signals' guard; the forward hooks on a model not in a DataParallel
        self.audit = Audit(False)  # the replay audit (audit.py), from the session's start
        self.in_step = False
        self.step_loader: int | None = None  # the loader whose batch began this step
        self.epochs_asked = False  # the script's loop starts at start_epoch(): its epochs are a trainguard loader's
        self.recent_loader: int | None = None  # the last loader a training batch came from since the last commit
        self.batches = StepBatches()  # the training batches each step takes (batches.py)
        self._resync: dict | None = None  # hand launches: hyperparameters to put back after an in-place recovery
        self.finished = False  # the job agreed to finish
        self.past_end = pastend.PastTheData()  # steps past the end of the data, skipped (pastend.py)

    # --- start --------------------------------------------------------------------------------

    def ensure_started(self) -> Session:
        if self.session is not None:
            return self.session
        opt = self.optimizer
        self.model = model = _model_of(opt.optimizer) or sharding.model_of(opt.optimizer)
        if model is None and any(sharding.is_sharded_tensor(p) for g in opt.param_groups for p in g["params"]):
            raise ConfigError("the optimizer's parameters are sharded (DTensors), but trainguard does not know their "
                              "model: call trainguard.fully_shard / trainguard.parallelize_module instead of torch's "
                              "(the same arguments)")
        self.stateful.update(discover.unregistered(opt.optimizer, [model, opt.lr_scheduler, *self.stateful.values()],
                                                   rewound=rewind_mod.rewound()))
        holds.check(model, opt.optimizer, self.stateful.values())  # one model, held, nothing training beside it
        state = TrainState(model=model, optimizer=opt.optimizer, scheduler=opt.lr_scheduler, extra=self.stateful,
                           sharded=sharding.is_sharded(model))
        rt = rt_mod.joined()
        callbacks = [obj for obj in self.stateful.values() if isinstance(obj, Callback)]  # a stream's anchors
        callbacks.append(unheld.UnheldWatch())  # modules training moves that nothing holds, named (unheld.py)
        if opt.checkpoints is not None:
            callbacks.append(ShardedSaver(opt.checkpoints, state, rt, sharding.job_mesh()))
        # the per-rank dying gasp: where the script gives sliced checkpoints, only if asked for, or for a dump after a
        # fault (a sliced save is collective and needs the dead ranks)
        default = opt.checkpoints is None or rt.cfg.recover_strategy.dump
        root = os.environ.get(CHECKPOINT_DIR_ENV) or (
            str(Path(rt.cfg.recovery_path) / "checkpoints") if rt.cfg.recovery_path is not None and default else "")
        if root:
            callbacks.append(ExceptionCheckpoint("job", root, CheckpointConfig(exception_save=True)))
        session = Session(state, SessionConfig(), runtime=rt, callbacks=callbacks)
        session.user_loop = True
        session.rewinds = rewinding.available()
        instep.arm(session)  # a failed exchange recovers inside the step, the script's setup not run again
        self.session = session
        self.audit = Audit(rt.cfg.exact != "off" and not rt.cfg.recover_strategy.elastic)  # other batches by design
        if isinstance(model, DataParallel):
            model.on_forward, model.after_forward, model.on_shard = (  # on_shard: a virtual shard's draws
                self.before_forward, self.after_forward, lambda shard: session.streams.shard_begins(session.step, shard))
        elif model is not None:
            self._hooks = [model.register_forward_pre_hook(lambda _m, _args: self.before_forward(), prepend=True),
                           # before FSDP2 gathers the parameters: a copy taken at the step's start reads the sharded ones
                           model.register_forward_hook(lambda _m, args, kwargs, out: self.after_forward(args, kwargs, out),
                                                       with_kwargs=True)]
            if sharding.stage_of(model) is not None:  # a pipeline stage: its schedule's steps begin the job's
                sharding.on_schedule_step(model, self.schedule_step)
        collectives.before_destroy = weakref.WeakMethod(self.before_destroy)  # the script's destroy_process_group()
        self._armed = session.stop.armed()
        self._armed.__enter__()  # SIGTERM/SIGINT/SIGUSR1: a graceful stop at the next commit point
        session.start()
        self.batches.restore(session.passes.ahead)
        if session.step:  # the job's optimizer has stepped: its schedulers are not warned that they step first
            discover.resumed_schedulers([opt.lr_scheduler, *self.stateful.values()])
        tail.restored()
        if rt.rank == 0 and session.step and session.in_epoch and session.train_loader is None:
            loaders = plainloaders.torch_loaders()  # a restore mid-epoch that torch's loaders cannot follow?
            if loaders:
                print(plainloaders.mid_epoch_warning(session.step, session.epoch, session.in_epoch, loaders),
                      file=sys.stderr, flush=True)
        atexit.register(self._at_exit)
        return session

    def close(self) -> None:
        """This run of the script is over (a rewind): disarm the signals, forget the exit barrier."""
        tail.left(self.session.step if self.session is not None else 0)
        plainvars.rewound()
        if self._armed is not None:
            self._armed.__exit__(None, None, None)
            self._armed = None
        atexit.unregister(self._at_exit)
        if isinstance(self.model, DataParallel):
            self.model.on_forward = self.model.after_forward = self.model.on_shard = None
            self.model.close()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def before_forward(self) -> None:
        """A training forward begins the step; an eval forward (no grad, or eval mode) is only a check."""
        if self.in_step:
            return
        if self._training_forward():
            self.begin_step()
        else:
            self.poll()

    def schedule_step(self, training: bool) -> None:
        """A pipeline schedule's step begins (train/parallel/pipeline.py), before its first receive: a training one
        begins the job's step, as a first forward would."""
        if not self.in_step:
            self.begin_step() if training and torch.is_grad_enabled() else self.poll()

    def after_forward(self, args: tuple = (), kwargs: dict | None = None, out=None) -> None:
        """A training forward of the step returned: the replay audit fingerprints it (audit.py), and the random
        streams are keyed for what the script draws next (train/state/streams.py: a batch prefetched during the
        step comes back the same after a restore)."""
        if self.in_step and self._training_forward():
            session = self.session
            found = self.audit.forward(session.step, session.restores, (args, kwargs or {}), out)
            if found is not None:
                audit.report(session, found)
            session.streams.forward_done(session.step)
            self.batches.forward()
            if session.streams.forwards == 1:
                session.phase_point("after_forward")  # a fault injection point (faults.py: kill-forward)

    def _training_forward(self) -> bool:
        return (torch.is_grad_enabled() and self.model is not None and self.model.training
                and not sharding.inferring())  # a pipeline stage learning its shapes: not a forward of the step

    def poll(self, between: bool = False) -> None:
        """Between steps (an eval batch or forward): under a rewind, a recovery the commit left pending or a
        generation that is over goes back now; at the training loader's next batch (`between`) a rank recovers in
        place where it can (instep.py). Started by hand, recoveries wait for the next training step."""
        session = self.ensure_started()
        ledger.progressed()  # a batch or a forward: this rank is not stuck (worker/ledger.py)
        self.settle()
        if not session.rewinds or (between and instep.recover_between(session, self)):
            return
        session.before_step()
        if session.rt.broken():
            raise Rewind(f"generation {session.rt.generation} is over")

    def begin_step(self, batch=None, loader: int | None = None) -> None:
        session = self.ensure_started()
        session.before_step()  # a recovery noticed after the last commit happens here
        if self._resync is not None:
            session.state.put_back(self._resync)
            self._resync = None
        self.settle()
        session.streams.step_begins(session.step)  # after the batch that begins it was fetched (its own key)
        session.begin_step(batch)
        self.in_step = True
        prologue.step_began()
        if (found := tail.step_begins(session.step)) is not None:  # code after the update, skipped by this run? (tail.py)
            audit.report(session, found)
        plainvars.step_begins(session)  # after a rewind: the script's variables that started again (plainvars.py)
        self.step_loader = loader if loader is not None else self.recent_loader

    def training_batch(self, loader: int, lookahead: bool) -> bool:
        """A batch came through a plain pass: a candidate for the training loader if drawn in training mode (grad
        on, the model in train mode) before the job knows which loader that is; the training loader's own pass
        that was already under way when the first commit named it counts on."""
        known = self.session.train_loader if self.session is not None else None
        if known is not None and known != loader:  # another loader (eval), once the training one is known
            return False
        if self.model is None or (torch.is_grad_enabled() and self.model.training):
            self.recent_loader = loader
            self.batches.took(lookahead)
            return True
        return False

    # --- the commit point ------------------------------------------------------------------------

    def step(self, closure=None):
        session = self.ensure_started()
        loss = None
        if closure is not None:  # its backward is the step's gradient exchange: done before the update is decided
            loss = self._evaluate(closure)
        if not self.in_step and closure is None and self.past_end.skip(session):  # the loop ran past the data
            return None
        if not self.in_step:
            self.begin_step()
        self.in_step = False
        if (found := self.audit.update(session.step, self.optimizer.param_groups)) is not None:
            audit.report(session, found)  # the LR the script wrote: from a counter of its own that started again?
        batches = self.batches.commit(session.train_loader is not None)  # batches.py: one taken ahead is the next's
        try:
            result = self.optimizer.optimizer.step()
            if closure is not None:
                result = loss  # what torch's step(closure) returns
        except CollectiveFailed as exc:
            session.end_step(exc)  # rewinds, or (started by hand) recovers in place
            self._resync = session.state.hyperparameters()  # the script's scheduler.step() after this must not count
            return None
        if session.train_loader is None and self.step_loader is not None:  # before the commit: its copies and
            session.train_loader = self.step_loader  # checkpoints name the loader that drives the steps from now on
        elif session.train_loader is None and self.epochs_asked:
            raise ConfigError(NO_EPOCHS)
        session.end_step(None, batches, self.batches.committed_ahead())
        self.recent_loader = None
        tail.committed()
        return result

    def _evaluate(self, closure):
        """The closure once, under grad mode, as torch's first-order optimizers run it, but before the step hooks that
        commit or skip the update on its backward's exchange (the optimizer would call it after them)."""
        if isinstance(self.optimizer.optimizer, torch.optim.LBFGS):
            raise ConfigError("torch.optim.LBFGS evaluates its closure several times in one step, each a gradient "
                              "exchange, and trainguard commits or skips one exchange per step: use a first-order "
                              "optimizer, or LBFGS without trainguard.Optimizer")
        with torch.enable_grad():
            return closure()

    def settle(self) -> None:
        """What the script's `scheduler.step()` moved after steps skipped past the data is put back (pastend.py)."""
        if self.session is not None:
            self.past_end.settle(self.session.state)

    def _at_exit(self) -> None:
        """The last barrier, unless the script is failing: a peer that fails at the very end gets its state from us."""
        session = self.session
        if session is None or session.rt.failed or session.rt.finished or self.finished:
            return
        try:
            while not session.finish():
                pass
        except (SystemExit, Exception) as exc:  # leaving anyway; the scheduler learns it from the goodbye
            log.warning("rank %d: finishing: %s", session.rt.rank, exc)

    def before_destroy(self) -> None:
        """The script destroys its process group (after its last step): the checkpoint its last commit left due is
        written first, while the group is there (collective)."""
        if self.session is not None and not self.session.rt.finished:
            self.settle()
            self.session.flush_saves()

    # --- going back to the committed step (train/engine/rewind.py) ----------------------------------------

    def end_of_script(self) -> bool:
        """The script ran to its end: agree to finish, or (a peer failed meanwhile) go back. True: run again."""
        session = self.session
        if session is None or session.rt.finished:
            return False
        self.settle()
        try:
            session.flush_saves()  # the last step's checkpoint, due since its commit
        except rewind_mod.FAULTS as exc:
            return rewind_mod.prepare(exc)
        end = ledger.at_end()
        ledger.wait(end)  # a peer still blocked in a collective this rank never made: a desync (control/waits.py)
        try:
            finished = session.finish(recover=False)
        finally:
            ledger.done(end)
        if finished:
            self.finished = True
            return False
        return rewind_mod.prepare(Rewind("a peer failed before the job could finish"))


def _model_of(optimizer: torch.optim.Optimizer) -> DataParallel | None:
    """The DataParallel wrapping the optimizer's parameters."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for dp in list(DataParallel.instances):
        if params & {id(p) for p in dp.module.parameters()}:
            return dp
    return None


def active() -> Guard | None:  # the process's guard, once the optimizer is wrapped
    return _guard


def _forget() -> None:
    """A rewind: this run's wrappers are done; the script's next run makes a new optimizer, and a new guard."""
    global _guard
    if _guard is not None:
        _guard.close()
    _guard = None
    _pending_state.clear()  # registered before the optimizer of the run left behind was made: that run's objects


def _at_end() -> bool:
    """The script ran to its end: True if it must run again (a peer failed before the job could finish)."""
    if _guard is None or not _guard.end_of_script():
        return False
    _forget()
    return True


rewind_mod.closers.append(_forget)
rewind_mod.end_of_script = _at_end


def current() -> Guard:
    if _guard is None:
        raise ConfigError("no trainguard.Optimizer was created in this process: wrap the optimizer, "
                          "optimizer = trainguard.Optimizer(torch.optim.SGD(...)), before training")
    return _guard


def install(optimizer) -> "Guard":
    """The process's guard, for its trainguard.Optimizer (optimizer.py): one per process."""
    global _guard
    if _guard is not None:
        raise ConfigError("trainguard.Optimizer supports one optimizer per process; combine parameter groups "
                          "into one optimizer")
    _guard = Guard(optimizer)
    _pending_state.clear()
    return _guard




NO_EPOCHS = ("trainguard.start_epoch() gives the epoch a trainguard.DataLoader's passes have reached, but no "
             "trainguard.DataLoader gave this step its batch (a tensor sliced by index, as word_language_model's "
             "batchify; torch's DataLoader; data made in the loop): after a fault the loop would start again at the "
             "first epoch. Take the batches from trainguard.DataLoader (with trainguard.DistributedSampler), or count "
             "steps: `step0 = trainguard.start_step(0)`, start the epoch loop at `step0 // steps_per_epoch` and skip "
             "that epoch's first `step0 % steps_per_epoch` batches")


def register_state(name: str, obj) -> None:
    """Make `obj` (anything with `state_dict()` and `load_state_dict()`: a GradScaler, a second LR scheduler, a metric
    tracker) part of the job's state, restored with the model anywhere. Call it before training; names are unique."""
    for attr in ("state_dict", "load_state_dict"):
        if not callable(getattr(obj, attr, None)):
            raise ConfigError(f"register_state({name!r}, ...): the object has no {attr}()")
    target = _guard.stateful if _guard is not None else _pending_state
    if _guard is not None and _guard.session is not None:
        raise ConfigError(f"register_state({name!r}, ...) after training started: register it before the first "
                          "forward, batch, start_step() or start_epoch()")
    if name in target:
        raise ConfigError(f"register_state: the name {name!r} is taken")
    target[name] = obj

