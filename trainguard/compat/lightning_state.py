"""Lightning's bookkeeping as part of the job's committed state, and the loop entered at the committed update.

Taken when an update commits (inside `Strategy.optimizer_step`, right after the step), the same on every rank:
its loops' progress (epochs, batches, optimizer steps, scheduler steps, validation batches), the callbacks'
`state_dict()`s, the datamodule's, the optimizer's hyperparameters and the LR schedulers' states before the
schedulers step, `trainer.should_stop`, and where the logger connector is in the epoch. Per rank, and gathered from
every rank inside the step (compat/lightning_ranks.py: one asynchronous all-gather of a few numbers, started before
the backward and finished before the update, so it is the step's own exchange): the values `self.log` has
accumulated in the epoch, the logged and callback metrics, and the step's output (what `on_train_batch_end`
receives). A replacement needs its own of those.

The run after a restore enters Lightning's loops at the committed update, as if it came back from
`optimizer.step()`: the first epoch's start is not run again (`on_train_epoch_start` ran before the update), and
the committed batch's remaining work is done there, with Lightning's own calls in Lightning's order (the LR
schedulers' steps, `on_train_batch_end` with the batch read again from the loader, the step's log, then
`on_advance_end`: the validation due, the epoch's end). Then the loops go on as they would have.

The private names of Lightning this uses are listed in `NEEDS` and checked at import (`supported()`).
"""

from __future__ import annotations

import copy
import os
import time

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loops import _TrainingEpochLoop
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector

from ..checkpoint.codec import WALLCLOCK
from ..errors import ConfigError
from ..train.data import loaders
from ..train.parallel.ddp import DataParallel
from .lightning_ranks import RankParts, rank_part
from .lightning_results import detached, load_results, on_device, results_state

OLDEST = "2.4"
# Lightning's names used beyond its public API (its instance attributes, which cannot be checked before a Trainer
# exists, are the logger connector's `_first_loop_iter`, `_current_fx` and three metric dicts, and the trainer's
# `_logger_connector` and `_checkpoint_connector`)
NEEDS = ((_TrainingEpochLoop, ("update_lr_schedulers", "_num_ready_batches_reached", "_should_accumulate",
                               "on_advance_end", "batch_idx", "advance", "done")),
         (_FitLoop, ("on_advance_start", "state_dict", "load_state_dict")),
         (_LoggerConnector, ("on_batch_end", "update_train_step_metrics")),
         (LightningModule, ("_on_before_batch_transfer",)),
         (Trainer, ("_results",)))
STEP_PROGRESS = "epoch_loop.automatic_optimization.optim_progress"


def missing() -> list[str]:
    return [f"{cls.__name__}.{name}" for cls, names in NEEDS for name in names if not hasattr(cls, name)]


def supported() -> bool:
    return not missing()


_IMMUTABLE = (str, int, float, bool, bytes, type(None))


def snapshot(value):
    """A copy of a state dict as it is now (tensors cloned), cheaper than `copy.deepcopy` for the nested dicts of
    numbers Lightning's loops and callbacks give (one is taken at every commit)."""
    if isinstance(value, _IMMUTABLE):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value) is dict:
        return {k: snapshot(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(snapshot(v) for v in value)
    return copy.deepcopy(value)


def no_sigterm_broadcast(trainer) -> None:
    """Lightning 2.5 and newer broadcast rank 0's SIGTERM flag before every training batch: one synchronous
    collective a step, as costly on CPU as the gradient exchange itself. Under trainguard SIGTERM is trainguard's
    (the strategy puts its handler back over Lightning's, so the flag stays down): every rank's stop vote already
    rides in the gradient exchange (train/parallel/gradsync.py), and the job stops at the same commit everywhere.
    The broadcast is left out; older Lightning has none."""
    loop = trainer.fit_loop.epoch_loop
    if hasattr(type(loop), "_broadcast_sigterm_tensor"):
        loop._broadcast_sigterm_tensor = lambda: None


# --- the book ------------------------------------------------------------------------------------------------------

class Book:
    """Lightning's bookkeeping as the last committed update left it; one object for `register_state`."""

    def __init__(self, trainer, strategy) -> None:
        self.trainer, self.strategy = trainer, strategy
        self.parts = RankParts(strategy.model if isinstance(strategy.model, DataParallel) else None)
        self.ranks: dict | None = None  # every rank's part, gathered inside the step being taken
        self.committed: dict | None = None
        self.restored: dict | None = None
        self.output = None
        # after trainguard's own pre-hook (registered when the job started): a failure skips the update. Only in
        # Lightning's update: torch's distributed state dicts step an FSDP2 model's optimizer to make its state
        strategy.optimizers[0].register_step_pre_hook(
            lambda _opt, _args, _kwargs: self._gathered() if strategy.in_update else None)

    # taking

    def start_gather(self, loss: torch.Tensor | None, extra: dict) -> None:
        """Right before the backward of the batch the update follows (the training step has logged its values): this
        rank's part, sent while the backward runs and the gradients are exchanged, behind nothing."""
        output = {"loss": loss, **extra} if loss is not None else {}  # Lightning's step output
        connector = self.trainer._logger_connector
        self.parts.start({"results": results_state(self.trainer._results, detached),  # start() copies the numbers
                          "callback_metrics": detached(dict(connector._callback_metrics)),
                          "logged_metrics": detached(dict(connector._logged_metrics)),
                          "progress_bar_metrics": detached(dict(connector._progress_bar_metrics)),
                          "output": detached(output)})

    def _gathered(self) -> None:
        """Right before the update (an optimizer pre-hook, after trainguard's): every rank's part."""
        if self.parts.pending is None:  # no backward this step (the training step returned None)
            self.start_gather(None, {})
        self.ranks = self.parts.finish()

    def committed_update(self) -> None:
        """Right after an update committed: the loops' state as `optimizer.step()` returning leaves it."""
        trainer = self.trainer
        loops = snapshot(trainer.fit_loop.state_dict())
        step = loops[STEP_PROGRESS]["optimizer"]["step"]
        for part in ("total", "current"):  # the loop counts the step completed right after this returns
            step[part]["completed"] += 1
        connector = trainer._logger_connector
        self.committed = {
            "loops": loops,
            "hyper": self._hyperparameters(),
            "callbacks": {cb.state_key: snapshot(cb.state_dict()) for cb in trainer.callbacks if cb.state_dict()},
            "datamodule": snapshot(trainer.datamodule.state_dict()) if trainer.datamodule is not None else {},
            "should_stop": bool(trainer.should_stop),
            "first_loop_iter": connector._first_loop_iter,
            "current_fx": connector._current_fx,
            WALLCLOCK: time.time(),  # files written after it and before a restore are the failed run's (below)
            "ranks": self.ranks or {},
        }
        self.ranks = None
        self._end_of_batches()  # after the book is the update's: the pass's end takes it

    def _hyperparameters(self) -> dict:
        """The optimizer's hyperparameters and the LR schedulers' states as the update left them: the rest of the
        batch steps the schedulers, and does it again after a restore (what the job keeps of them is live, and a
        fault after that step would step them twice)."""
        groups = self.strategy.optimizers[0].param_groups
        return {"groups": [{k: snapshot(v) for k, v in g.items() if k != "params"} for g in groups],
                "schedulers": [snapshot(c.scheduler.state_dict()) for c in self.trainer.lr_scheduler_configs]}

    def _put_back_hyperparameters(self, saved: dict) -> None:
        for group, values in zip(self.strategy.optimizers[0].param_groups, saved["groups"]):
            group.update(values)
        for config, state in zip(self.trainer.lr_scheduler_configs, saved["schedulers"]):
            config.scheduler.load_state_dict(copy.deepcopy(state))

    def _end_of_batches(self) -> None:
        """The epoch's last batch was updated: the training loader's pass ends here, before the epoch's schedulers
        step (the position's hyperparameters are the update's: the schedulers step again after a restore)."""
        if self.trainer.fit_loop.epoch_loop._num_ready_batches_reached() and self.strategy.train_loader is not None:
            loaders.end_pass(self.strategy.train_loader)

    def state_dict(self) -> dict:
        return self.committed or {}

    def load_state_dict(self, state: dict) -> None:
        self.committed = dict(state) or None
        self.restored = self.committed

    # resuming

    def resume_epoch(self) -> int:
        return int(self.restored["loops"]["epoch_progress"]["current"]["processed"])

    def resume(self) -> None:
        """A restored job: Lightning's own resume from `ckpt_path` is dropped (the job's state is newer), and the first
        epoch the fit loop starts is entered at the committed update. The sanity check runs as in the job's first run
        (it makes the validation loaders first: the loaders are numbered in the order they are made)."""
        if self.restored is None:
            raise ConfigError("the job's committed state has no Lightning bookkeeping: it was saved by another script "
                              "(resume it with the script that saved it)")
        trainer = self.trainer
        trainer._checkpoint_connector.resume_end()
        fit_loop, epoch_loop = trainer.fit_loop, trainer.fit_loop.epoch_loop
        advance_start, epoch_run = fit_loop.on_advance_start, epoch_loop.run

        def enter_epoch():
            fit_loop.on_advance_start = advance_start  # once
            self._apply()

        def enter_batches(data_fetcher):
            epoch_loop.run = epoch_run  # once
            self._finish_committed_batch(data_fetcher)

        fit_loop.on_advance_start = enter_epoch
        epoch_loop.run = enter_batches

    def _apply(self) -> None:
        """The committed state into Lightning's objects, as the fit loop's first epoch starts (after the sanity check,
        which resets the logged metrics)."""
        saved, trainer = self.restored, self.trainer
        fit_loop = trainer.fit_loop
        fit_loop.load_state_dict(copy.deepcopy(saved["loops"]))
        fit_loop.restarting = False  # the loops go on from here, not through Lightning's own restart
        for cb in trainer.callbacks:
            if cb.state_key in saved["callbacks"]:
                state = copy.deepcopy(saved["callbacks"][cb.state_key])
                if any(cb is placed for placed in self.strategy.placed_checkpoints) and "dirpath" in state:
                    cb.dirpath = state["dirpath"]  # the job's folder, not this run's logger version's (see below)
                cb.load_state_dict(state)
                if "current_score" in state and hasattr(cb, "current_score"):  # in ModelCheckpoint's state_dict, left
                    cb.current_score = state["current_score"]  # out of its load_state_dict (Lightning 2.6)
        for cb in trainer.checkpoint_callbacks:
            if hasattr(cb, "file_exists") and WALLCLOCK in saved:
                cb.file_exists = _ExistedBefore(cb.file_exists, saved[WALLCLOCK], time.time())
        if trainer.datamodule is not None and saved["datamodule"]:
            trainer.datamodule.load_state_dict(copy.deepcopy(saved["datamodule"]))
        trainer.should_stop = saved["should_stop"]
        self._put_back_hyperparameters(saved["hyper"])
        mine = rank_part(saved["ranks"], trainer.global_rank)
        device = self.strategy.root_device
        load_results(trainer._results, mine["results"], trainer.lightning_module, self.strategy.reduce, device)
        connector = trainer._logger_connector
        for name in ("callback_metrics", "logged_metrics", "progress_bar_metrics"):
            target = getattr(connector, f"_{name}")
            target.clear()
            target.update(on_device(mine[name], device))
        connector._first_loop_iter = saved["first_loop_iter"]
        connector._current_fx = saved["current_fx"]
        self.output = on_device(mine["output"], device)

    # A ModelCheckpoint given no folder saves under the logger's version folder, and a logger picks the next free
    # version in each run of the script (as in Lightning's own resume: its CSVLogger deletes the metrics file of a
    # version it writes again). Placed anew after a fault, the callback would keep its best models elsewhere and,
    # its folder changed, drop its record of them (ModelCheckpoint.load_state_dict): another set of checkpoints,
    # other files deleted. It goes on in the folder the job's first run gave it.

    def _finish_committed_batch(self, data_fetcher) -> None:
        """The committed batch's work after its update, as `_TrainingEpochLoop.advance` does it, then the epoch's
        batches from the next one on (`_TrainingEpochLoop.run` without its reset)."""
        trainer, loop = self.trainer, self.trainer.fit_loop.epoch_loop
        self.restored = None
        data_fetcher.fetched += loop.batch_progress.current.ready
        batch = self.strategy.replayed_batch()
        batch = trainer.precision_plugin.convert_input(batch)
        batch = trainer.lightning_module._on_before_batch_transfer(batch, dataloader_idx=0)
        batch = call._call_strategy_hook(trainer, "batch_to_device", batch, dataloader_idx=0)
        trainer._results.batch = batch
        batch_idx = loop.batch_idx
        self._end_of_batches()
        loop.batch_progress.increment_processed()
        loop.update_lr_schedulers("step", update_plateau_schedulers=False)
        if loop._num_ready_batches_reached():
            loop.update_lr_schedulers("epoch", update_plateau_schedulers=False)
        call._call_callback_hooks(trainer, "on_train_batch_end", self.output, batch, batch_idx)
        call._call_lightning_module_hook(trainer, "on_train_batch_end", self.output, batch, batch_idx)
        trainer._logger_connector.on_batch_end()
        loop.batch_progress.increment_completed()
        trainer._logger_connector.update_train_step_metrics()
        self.output = None
        done = getattr(loop, "on_iteration_done", lambda: None)  # Lightning 2.5 and newer
        try:
            loop.on_advance_end(data_fetcher)
        finally:
            done()
        while not loop.done:
            try:
                loop.advance(data_fetcher)
                loop.on_advance_end(data_fetcher)
            except StopIteration:
                break
            finally:
                done()


class _ExistedBefore:
    """A ModelCheckpoint's `file_exists` after a restore: a checkpoint file the failed run wrote after the committed
    update and before the restore does not count as there. The run after the restore saves the same step's
    checkpoint again, under the name the run without a fault gave it, where Lightning's version counter would
    add `-v1` (a blind port's kill in the validation at an epoch's end: `epoch=0-step=15-v1.ckpt` in best_k_models).
    Rank 0 decides and every rank follows (Lightning's own reduce, one collective as before); a file on a remote
    filesystem (a URL) is left to Lightning."""

    def __init__(self, lightnings, committed: float, restored: float) -> None:
        self.lightnings, self.committed, self.restored = lightnings, committed, restored

    def __call__(self, filepath, trainer) -> bool:
        path = os.fspath(filepath)
        if "://" in path:
            return self.lightnings(filepath, trainer)
        there = trainer.is_global_zero and os.path.exists(path) and not (
            self.committed <= os.path.getmtime(path) < self.restored)
        return trainer.strategy.reduce_boolean_decision(there, all=False)
