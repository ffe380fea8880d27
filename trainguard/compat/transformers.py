"""The Hugging Face `transformers` Trainer under trainguard: `from trainguard.compat.transformers import Trainer`.

A Trainer script changes one line, the import. The Trainer's loop is its own; under `trainguard run` it is run
again from the top after a fault, like any script, and this subclass makes that run resume where the job is:

- **its Accelerator is trainguard's** (compat/accelerate.py): the model in trainguard's DDP, the optimizer in
  `trainguard.Optimizer` (the commit point is the real update, once per gradient-accumulation cycle), the
  training loader a `ReplayedLoader` that resumes at the committed batch by itself. The LR scheduler the Trainer
  makes is found on the optimizer and kept with the job's state;
- **the Trainer's bookkeeping is part of the committed state**: its `TrainerState` (global step, log history,
  best metric, stateful callbacks such as early stopping), its control flags, the loss summed since the last log,
  the step's gradient norm and learning rate, taken right before the update (`on_pre_optimizer_step`) and kept
  once the update committed (`on_optimizer_step`);
- **the run after a restore is the Trainer's own resume**, handed what it reads: the optimizer, model and
  scheduler are prepared first, so the job's state is in them before the Trainer counts where it is; its epoch
  loop then starts at the committed epoch and batch, and the committed step's bookkeeping (its log line, its
  evaluation, its checkpoint, `on_step_end`) is done again, from the state as the update left it. So a fault in
  an evaluation, a log's all-gather or the Trainer's own save, all after the update, loses nothing and repeats
  nothing: the log history is the uninterrupted run's. The Trainer's RNG files are not needed (trainguard keys
  the random streams by step), nor its `skip_first_batches` (the loader resumes itself).

Supported: data parallelism on CPU or GPU, gradient accumulation, any scheduler the Trainer makes, evaluation and
saving by steps or epochs, stateful callbacks. Not covered: DeepSpeed, FSDP, `elastic`, and a Trainer resumed from
its own checkpoint in the middle of an epoch (`resume_from_checkpoint` on the job's first run) that then meets a
fault in that same epoch: a ConfigError says so (the loader its resume made cannot be made again).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import sys

import torch
import torch.distributed as dist
import transformers
import transformers.trainer as trainer_mod
from transformers.trainer_callback import ExportableState, TrainerCallback, TrainerControl, TrainerState

from ..errors import ConfigError
from ..train.data import loaders
from ..train.data.replayed import ReplayedLoader
from ..train.engine import guard as guard_mod
from ..worker.transfer import gather_into
from ..checkpoint.codec import WALLCLOCK
from . import accelerate as tg_accelerate

__all__ = ["Trainer"]

# the loop steps these after an evaluation, with its metrics (GreedyLR: newer transformers only)
_STEPPED_BY_METRICS = (torch.optim.lr_scheduler.ReduceLROnPlateau,
                       *[getattr(trainer_mod, name) for name in ("GreedyLR",) if hasattr(trainer_mod, name)])
RESTORED = "<trainguard: the job's committed state>"  # the resume point handed to the Trainer's loop
_NEEDS = ("_init_training_state", "_prepare_for_training", "_run_epoch", "_maybe_log_save_evaluate",
          "_get_grad_norm", "_load_rng_state", "create_accelerator_and_postprocess")
_missing = [name for name in _NEEDS if not callable(getattr(transformers.Trainer, name, None))]
if _missing:
    raise ConfigError(f"transformers {transformers.__version__}'s Trainer lacks {', '.join(_missing)}: "
                      "trainguard.compat.transformers supports transformers 5.3 and newer")


@contextlib.contextmanager
def _named(module, name: str, value):
    """`module.name` is `value` for the call (the Trainer looks these names up in its module)."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def _committed_steps() -> int:
    guard = guard_mod.active()
    return guard.session.step if guard is not None and guard.session is not None else 0


def _every_ranks(values: torch.Tensor) -> torch.Tensor:
    """[world, n]: every rank's `values` (n numbers), in rank order."""
    values = values.reshape(-1)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values.reshape(1, -1)
    out = torch.empty(dist.get_world_size() * values.numel(), dtype=values.dtype, device=values.device)
    gather_into()(out, values)
    return out.reshape(dist.get_world_size(), -1)


def measured(key: str) -> bool:
    """A logged value the clock measured (the Trainer's `speed_metrics` and memory metrics), which no two runs share."""
    return key.endswith("_runtime") or key.endswith("_per_second") or "_mem_" in key


def split_clock(history: list[dict]) -> tuple[list[dict], list[list]]:
    """The log history without its measured values, and those values as [entry, key, value] (pure)."""
    kept, clock = [], []
    for i, entry in enumerate(history):
        kept.append({k: v for k, v in entry.items() if not measured(k)})
        clock.extend([i, k, v] for k, v in entry.items() if measured(k))
    return kept, clock


def join_clock(history: list[dict], clock: list[list]) -> list[dict]:
    """`split_clock` undone (pure)."""
    out = [dict(entry) for entry in history]
    for i, key, value in clock:
        out[i][key] = value
    return out


class Bookkeeping:
    """The Trainer's bookkeeping as the last committed update left it, before the Trainer stepped its scheduler,
    logged, evaluated or saved for that step; one object for `register_state`. What the clock measured (runtimes,
    throughputs) is kept apart, under `WALLCLOCK`, which `trainguard verify` does not compare."""

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer
        self.pending: tuple[dict, int] | None = None  # taken before the update, with the commits then
        self.committed: dict | None = None  # `take()`'s, of the last committed update
        self.serial: dict | None = None  # `committed` as `state_dict()` gives it, made once
        self.restored: dict | None = None  # loaded by a restore, applied when the Trainer's loop starts

    def take(self) -> dict:
        """Inside the step, right before the update: the same on every rank (the loss sums are gathered). Cheap: the
        state's log history is copied as a list (its entries are never changed), and made JSON only by
        `state_dict()`, which a fault or a checkpoint asks for."""
        t = self.trainer
        state = dataclasses.replace(t.state, stateful_callbacks=dict(t.state.stateful_callbacks),
                                    log_history=list(t.state.log_history))
        for cb in t.callback_handler.callbacks:  # as the Trainer's own save does
            if isinstance(cb, ExportableState):
                state.stateful_callbacks[type(cb).__name__] = cb.state()
        # the Trainer's control is recorded here by rank 0 alone, when it saves a checkpoint (and read back only by
        # that save, which records it first); kept as every other rank has it, so that a replacement's is its rank's
        state.stateful_callbacks["TrainerControl"] = TrainerControl().state()
        grad_norm = t.last_grad_norm
        loss = t.tr_loss.detach().reshape(()).to(torch.float64)
        ranks = _every_ranks(torch.stack([loss, torch.tensor(float(t.current_flos), dtype=torch.float64,
                                                             device=loss.device)])).to("cpu", copy=True)
        return {"trainer_state": state,
                "control": t.control.state(),
                "scheduler": copy.deepcopy(t.lr_scheduler.state_dict()) if t.lr_scheduler is not None else None,
                # the loss summed since the last log is each rank's own, and the log is their mean; so are the
                # flops counted since (store_flos sums them at a log or save: each rank's batches pad to their own
                # lengths): the state holds every rank's, so that a replacement has its own (one small all_gather
                # per update; float64 holds a float32 loss exactly)
                "tr_loss": ranks[:, 0].to(t.tr_loss.dtype),
                "total_loss_scalar": float(t.total_loss_scalar),
                "globalstep_last_logged": int(t.globalstep_last_logged),
                "initial_global_step": t.initial_global_step,
                "current_flos": ranks[:, 1].tolist(),
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "learning_rate": float(t.lr_now())}

    def before_update(self) -> None:
        self.pending = (self.take(), _committed_steps())

    def after_update(self, skipped: bool) -> None:
        if self.pending is not None and _committed_steps() > self.pending[1]:
            self.committed = {**self.pending[0], "update_skipped": bool(skipped)}
            self.serial = None
        self.pending = None

    def state_dict(self) -> dict:
        if self.committed is None:
            return {}
        if self.serial is None:  # the TrainerState as JSON, what the clock measured apart
            taken = dict(self.committed)
            state = taken.pop("trainer_state")
            history, clock = split_clock(state.log_history)
            state = dataclasses.replace(state, log_history=history)
            self.serial = {**taken, "state": json.dumps(dataclasses.asdict(state), sort_keys=True),
                           WALLCLOCK: json.dumps(clock)}
        return self.serial

    def load_state_dict(self, state: dict) -> None:
        self.restored = dict(state) or None
        self.committed, self.serial = None, None
        if self.restored is not None:
            restored = dict(self.restored)
            trainer_state = TrainerState(**json.loads(restored.pop("state")))
            trainer_state.log_history = join_clock(trainer_state.log_history, json.loads(restored.pop(WALLCLOCK)))
            self.committed = {**restored, "trainer_state": trainer_state}


class _Commits(TrainerCallback):
    def __init__(self, book: Bookkeeping) -> None:
        self.book = book

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.book.before_update()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.book.after_update(self.book.trainer.accelerator.optimizer_step_was_skipped)

    def on_epoch_end(self, args, state, control, **kwargs):
        loader = self.book.trainer.train_loader
        if isinstance(loader, ReplayedLoader):  # the loop counts its batches: its iterator never ended
            loaders.end_pass(loader)


class Trainer(transformers.Trainer):
    """transformers' Trainer, resumed where the job is after a fault; see the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.book = Bookkeeping(self)
        self.add_callback(_Commits(self.book))
        self.last_grad_norm = None
        self.prepared = None  # (model, loader) prepared ahead by _init_training_state
        self.train_loader = None
        self.resume_at: tuple[int, int] | None = None  # (epoch, batches of it) of a restored job

    # --- names the bookkeeping reads (the Trainer's loop sets them) -------------------------------------------

    @property
    def tr_loss(self) -> torch.Tensor:
        return self._tr_loss

    @property
    def total_loss_scalar(self) -> float:
        return self._total_loss_scalar

    @property
    def globalstep_last_logged(self) -> int:
        return self._globalstep_last_logged

    @property
    def initial_global_step(self) -> int | None:
        return getattr(self, "_initial_global_step", None)  # the first step of this train() call (newer transformers)

    def lr_now(self) -> float:
        return self._get_learning_rate()

    # --- the Trainer's steps, as this subclass changes them ---------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        with _named(trainer_mod, "Accelerator", tg_accelerate.Accelerator):
            super().create_accelerator_and_postprocess()

    def get_train_dataloader(self):
        self.train_loader = super().get_train_dataloader()
        return self.train_loader

    def get_eval_dataloader(self, eval_dataset=None):
        with self.accelerator.loaders_per_use():  # one per evaluation (a verify once found a kept pass moved to another)
            return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset):
        with self.accelerator.loaders_per_use():
            return super().get_test_dataloader(test_dataset)

    def _get_grad_norm(self, model, grad_norm=None):
        self.last_grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        return self.last_grad_norm

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint,
                             trial):
        guard_mod.register_state("transformers:trainer", self.book)
        counted = super()._init_training_state(max_steps, num_update_steps_per_epoch, num_train_epochs,
                                               resume_from_checkpoint, trial)
        # the optimizer and the model's wrapping first, so that the job's state is in them before the loop counts
        self.prepared = super()._prepare_for_training(max_steps, self.train_loader, resume_from_checkpoint)
        session = guard_mod.current().ensure_started()  # joins the job: a restore fills the objects and the book
        self.resume_at = None
        if not session.step:
            return counted
        if self.book.restored is None:
            raise ConfigError("the job's committed state has no Trainer bookkeeping: it was saved by another script "
                              "(resume it with the script that saved it)")
        self.state = copy.deepcopy(self.book.committed["trainer_state"])
        self._load_exportable(self.state.stateful_callbacks)
        self.state.init_training_references(self, max_steps, num_train_epochs, trial)
        self.resume_at = (session.epoch, session.in_epoch)
        return self.resume_at

    def _load_exportable(self, saved: dict) -> None:
        """The stateful callbacks as the committed step left them (the Trainer's own `_load_callback_state`, always)."""
        for cb in list(self.callback_handler.callbacks):
            data = saved.get(type(cb).__name__)
            if isinstance(cb, ExportableState) and isinstance(data, dict):
                fresh = type(cb)(**data.get("args", {}))
                for attribute, value in data.get("attributes", {}).items():
                    setattr(fresh, attribute, value)
                self.callback_handler.remove_callback(cb)
                self.callback_handler.add_callback(fresh)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self.prepared is None:  # not through _init_training_state: the Trainer's order
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        prepared, self.prepared = self.prepared, None
        return prepared

    def _load_rng_state(self, checkpoint):
        if checkpoint != RESTORED:  # a restore: trainguard's random streams are already where the job is
            super()._load_rng_state(checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if resume_from_checkpoint != RESTORED:
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _run_epoch(self, **kw):
        if self.resume_at is None or kw["epoch"] != self.resume_at[0]:
            with _named(trainer_mod, "skip_first_batches", self._skip_fresh):
                return super()._run_epoch(**kw)
        epoch, in_epoch = self.resume_at
        self.resume_at = None
        kw.update(resume_from_checkpoint=RESTORED, epochs_trained=epoch, steps_trained_in_current_epoch=in_epoch)
        self._finish_committed_step(kw["model"], epoch, in_epoch, kw["steps_in_epoch"], kw["trial"],
                                    kw["ignore_keys_for_eval"], kw["start_time"])
        with _named(trainer_mod, "skip_first_batches", self._skip_restored):
            return super()._run_epoch(**kw)

    def _finish_committed_step(self, model, epoch, in_epoch, steps_in_epoch, trial, ignore_keys, start_time) -> None:
        """The committed step's bookkeeping, as the loop does it after the update, from the state the update left."""
        saved, self.book.restored = self.book.committed, None
        self.control = type(self.control)(**saved["control"]["args"])
        for attribute, value in saved["control"]["attributes"].items():
            setattr(self.control, attribute, value)
        mine = self.args.process_index if saved["tr_loss"].numel() > 1 else 0
        self._tr_loss = saved["tr_loss"][mine].clone().to(self.args.device)
        self._total_loss_scalar = saved["total_loss_scalar"]
        self._globalstep_last_logged = saved["globalstep_last_logged"]
        if saved["initial_global_step"] is not None:
            self._initial_global_step = saved["initial_global_step"]
        flos = saved["current_flos"]  # every rank's (a single float: a state from before they were kept per rank)
        self.current_flos = flos[mine] if isinstance(flos, list) else flos
        if saved["scheduler"] is not None:  # as the update left it; the loop steps it after the update
            self.lr_scheduler.load_state_dict(saved["scheduler"])
            if not saved["update_skipped"] and not isinstance(self.lr_scheduler, _STEPPED_BY_METRICS):
                self.lr_scheduler.step()
        self.state.global_step += 1
        self.state.epoch = epoch + in_epoch / steps_in_epoch
        self.control = self.callback_handler.on_step_end(self.args, self.state, self.control)
        self._maybe_log_save_evaluate(self._tr_loss, saved["grad_norm"], model, trial, epoch, ignore_keys, start_time,
                                      learning_rate=saved["learning_rate"])

    def _skip_restored(self, loader, num_batches: int = 0):
        if not isinstance(loader, ReplayedLoader):
            raise ConfigError(f"the Trainer's training loader is a {type(loader).__name__}, not the loader trainguard "
                              "prepared: a Trainer subclass that builds its own cannot resume where the job is")
        if guard_mod.current().ensure_started().train_loader != loader.tg_index:
            raise ConfigError("the job's training loader was the one the Trainer's own resume made in the middle of an "
                              "epoch (resume_from_checkpoint on the job's first run), which trainguard cannot make "
                              "again: resume the Trainer from a checkpoint saved at an epoch's end")
        return loader  # it resumes at the committed batch by itself

    def _skip_fresh(self, loader, num_batches: int = 0):
        """The Trainer's own resume on a fresh job (`resume_from_checkpoint` in the middle of an epoch)."""
        print(f"trainguard: the Trainer resumes from its own checkpoint {num_batches} batches into an epoch: a fault "
              "before that epoch ends cannot be recovered (resume from a checkpoint saved at an epoch's end)",
              file=sys.stderr, flush=True)
        return self.accelerator.skip_first_batches(loader, num_batches)
