"""PyTorch Lightning under trainguard: `Trainer(strategy=trainguard.compat.lightning.Strategy(), ...)`.

A Lightning script changes two lines: the import and the Trainer's `strategy` (for FSDP2, the import of
`ModelParallelStrategy` from here instead of Lightning's). Under `trainguard run` the script
runs again from the top after a fault, like any script, and `trainer.fit` resumes where the job is:

- **the processes are the job's** (`JobEnvironment`): rank, world size and local rank from `trainguard run`, the
  process group trainguard's (Lightning's `init_process_group` joins it, worker/pginit.py), no processes of
  Lightning's own;
- **the model** is wrapped in trainguard's `DDP` where Lightning would wrap it in torch's (with
  `ModelParallelStrategy`, the model `configure_model()` sharded with torch's FSDP2 or tensor-parallel calls, on the
  strategy's mesh, is the job's sharded model: train/parallel/sharding.py), and **the optimizer's
  update goes through `trainguard.Optimizer`**: Lightning keeps its own optimizer object (its checkpoints, its
  LR monitor, `configure_optimizers` see the script's), and the strategy steps it through trainguard's wrapper,
  whose step is the commit point (once per gradient-accumulation cycle, the real update). The LR schedulers
  Lightning steps are found on the optimizer and kept with the state;
- **each loader** Lightning made is wrapped in a `ReplayedLoader` (train/data/replayed.py): the training loader
  resumes at the committed batch by reading its pass again (its order is the sampler's, whose epoch Lightning
  sets); the others are checked for a moved cluster at every batch;
- **Lightning's own bookkeeping is part of the committed state** (compat/lightning_state.py): its loops' progress,
  the callbacks' states (ModelCheckpoint's best models, EarlyStopping's patience), the values each rank has logged
  in the epoch, torchmetrics objects included (every rank's: a replacement needs its own), taken as the update
  commits;
- **the run after a restore enters the loop at the committed update** and does that batch's remaining work there:
  the LR schedulers' steps, `on_train_batch_end`, the step's logging, the validation due after it, the epoch's end.
  A fault in any of them (a validation's `sync_dist`, ModelCheckpoint's barrier) therefore loses nothing and
  repeats nothing.

SIGTERM is trainguard's graceful stop (a dying gasp at the next commit, which the same command resumes from), not
Lightning's, which would end the job without one. Supported: automatic optimization with one optimizer, data
parallelism on CPU or GPU, FSDP2 and tensor parallelism through `ModelParallelStrategy`, gradient accumulation, LR
schedulers by step or by epoch, validation, callbacks with `state_dict()`, values and torchmetrics objects given to
`self.log`, loggers. Not covered (a ConfigError at the
start): manual optimization, several optimizers, a training loader without a length; not covered silently: state a
LightningModule keeps outside its parameters, buffers and logged metrics (register it with
`trainguard.register_state`); not built: Lightning's FSDP1 strategy (`FSDPStrategy`).
"""

from __future__ import annotations

import contextlib
import os
import signal

import lightning
import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch import strategies as lightning_strategies
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from ..errors import ConfigError
from ..train.data import loaders, passes
from ..train.data.replayed import PassStarts, ReplayedLoader
from ..train.engine import guard as guard_mod
from ..train.engine.guard import register_state
from ..train.engine.optimizer import Optimizer
from ..train.parallel import sharding
from ..train.parallel.ddp import DataParallel
from . import lightning_state

__all__ = ["Strategy", "DDPStrategy", "ModelParallelStrategy", "JobEnvironment"]

if not lightning_state.supported():
    raise ConfigError(f"Lightning {lightning.__version__} lacks what trainguard.compat.lightning uses "
                      f"({', '.join(lightning_state.missing())}): it supports Lightning "
                      f"{lightning_state.OLDEST} and newer")


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise ConfigError(f"{name} is not set: run the script with `trainguard run`")
        return default
    return int(value)


class JobEnvironment(ClusterEnvironment):
    """The processes of a `trainguard run` job, as Lightning asks for them: started by trainguard, not by Lightning."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")  # not used: init_process_group joins trainguard's group

    @property
    def main_port(self) -> int:
        return _env_int("MASTER_PORT", 0)

    @staticmethod
    def detect() -> bool:
        return "RANK" in os.environ and "WORLD_SIZE" in os.environ

    def world_size(self) -> int:
        return _env_int("WORLD_SIZE")

    def set_world_size(self, size: int) -> None:
        pass  # the job's

    def global_rank(self) -> int:
        return _env_int("RANK")

    def set_global_rank(self, rank: int) -> None:
        pass  # the job's

    def local_rank(self) -> int:
        return _env_int("LOCAL_RANK", 0)

    def node_rank(self) -> int:
        return _env_int("GROUP_RANK", 0)


class _JobStrategy:
    """What both strategies add to Lightning's: the job's processes, trainguard's optimizer step, the loaders read
    again, Lightning's bookkeeping committed with the update; see the module docstring."""

    strategy_name = "trainguard"

    def _join_job(self, kwargs: dict) -> dict:
        for name in ("cluster_environment", "start_method", "parallel_devices"):
            if name in kwargs:
                raise ConfigError(f"trainguard.compat.lightning.{type(self).__name__}({name}=...): the processes are "
                                  "the job's (trainguard run --workers N); leave it out")
        self.tg_optimizer: Optimizer | None = None
        self.loader_starts = PassStarts(lambda loader: {}, lambda loader, state: None)  # Lightning sets the epochs
        self.book: lightning_state.Book | None = None
        self.train_loader: ReplayedLoader | None = None
        self.step_extra: dict = {}  # the training step's output but its loss (what Lightning hands on with the loss)
        self.in_update = False  # Lightning's optimizer step is under way (not a step of torch's own: DCP's state init)
        self.placed_checkpoints: list = []  # ModelCheckpoints the script gave no folder: Lightning places them
        self._sigterm = None  # trainguard's SIGTERM handler, put back over Lightning's
        return kwargs

    # --- the job's processes ------------------------------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type == "cuda":
            return torch.device("cuda", self.local_rank)
        return devices[0]

    @property
    def num_processes(self) -> int:
        return self.world_size // max(1, self.num_nodes)

    def set_world_ranks(self) -> None:  # the ranks are the job's: only Lightning's rank-zero helpers learn them
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _configure_launcher(self) -> None:
        self._launcher = None  # trainguard started the processes

    def setup_environment(self) -> None:
        super().setup_environment()
        trainer = self.lightning_module.trainer  # before the callbacks' setup: their own folders are still unset
        self.placed_checkpoints = [cb for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", "") is None]

    # --- the model, the optimizer, the loaders -----------------------------------------------------------------

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        super().setup_optimizers(trainer)
        module = self.lightning_module
        if not module.automatic_optimization:
            raise ConfigError("this LightningModule uses manual optimization (automatic_optimization = False), which "
                              "trainguard.compat.lightning does not cover: use automatic optimization (one optimizer: "
                              "its parameter groups can hold what several held), or write the loop yourself with "
                              "trainguard's wrappers (README, 'Keep your own loop')")
        if len(self.optimizers) != 1:
            raise ConfigError(f"configure_optimizers() returned {len(self.optimizers)} optimizers; trainguard "
                              "supports one: combine the parameter groups into one optimizer")
        self.tg_optimizer = Optimizer(self.optimizers[0])

    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self.book = lightning_state.Book(trainer, self)
        lightning_state.no_sigterm_broadcast(trainer)
        trainer.callbacks.insert(0, _PassEnd(self))
        register_state("lightning:loop", self.book)
        register_state("lightning:loaders", self.loader_starts)
        session = guard_mod.current().ensure_started()  # joins the job: a restore fills the model, the optimizer,
        self._sigterm = signal.getsignal(signal.SIGTERM)  # the schedulers and the book
        if session.step:
            self.book.resume()
            self._committed_epoch()

    def process_dataloader(self, dataloader):
        trainer = self.lightning_module.trainer
        if isinstance(dataloader, ReplayedLoader) or trainer.state.fn != TrainerFn.FITTING:
            return dataloader
        # (the training loader may be made before setup(): `estimated_stepping_batches` in configure_optimizers)
        loader = ReplayedLoader(dataloader, self.loader_starts, defer=True)  # Lightning sets the epoch after iter()
        if trainer.state.stage == RunningStage.TRAINING:
            if passes.pass_length(dataloader) is None:
                raise ConfigError("the training loader has no length (an IterableDataset without __len__): Lightning "
                                  "then fetches a batch ahead to find the epoch's last, and the committed batch cannot "
                                  "be placed. Give the dataset a __len__ (the batches an epoch), or train it with "
                                  "trainguard's wrappers (docs/porting.md)")
            self.train_loader = loader
            self._committed_epoch()
        return loader

    def _committed_epoch(self) -> None:
        """A restored job's training loader reads its pass again up to the committed batch as the pass is made: in
        the committed epoch's order, which Lightning would set only later."""
        if self.train_loader is not None and self.book is not None and self.book.restored is not None:
            set_epoch(self.train_loader, self.book.resume_epoch())

    def replayed_batch(self):
        """The committed batch, read again with the training loader's pass up to it."""
        if self.train_loader is not None:
            self.train_loader.begin_pass()
        batch = getattr(self.train_loader, "last_replayed", None)
        if batch is None:
            raise ConfigError("the training loader did not read its pass again up to the committed batch: a "
                              "Lightning training loader must be the one the Trainer made (train_dataloader())")
        return batch

    def training_step(self, *args, **kwargs):
        out = super().training_step(*args, **kwargs)
        extra = out.items() if isinstance(out, dict) else ()
        self.step_extra = {k: v for k, v in extra if k not in ("loss", "hiddens")}
        return out

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        loop = self.lightning_module.trainer.fit_loop.epoch_loop
        if self.book is not None and not loop._should_accumulate():  # the update follows this backward
            self.book.start_gather(closure_loss, self.step_extra)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        if self.tg_optimizer is None or optimizer is not self.tg_optimizer.optimizer:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        before = guard_mod.current().session.step
        self.in_update = True
        try:
            out = self.precision_plugin.optimizer_step(self.tg_optimizer, model=model or self.lightning_module,
                                                       closure=closure, **kwargs)
        finally:
            self.in_update = False
        if guard_mod.current().session.step > before:
            self.book.committed_update()
        return out

    # --- signals ----------------------------------------------------------------------------------------------

    def on_train_start(self) -> None:
        super().on_train_start()
        if self._sigterm is not None:  # Lightning's handler would end the job at the next batch, with no dying gasp
            signal.signal(signal.SIGTERM, self._sigterm)

    def teardown(self) -> None:
        super().teardown()
        self.tg_optimizer = None

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        pass  # not by name: Trainer(strategy=Strategy())


class Strategy(_JobStrategy, lightning_strategies.DDPStrategy):
    """Lightning's DDP strategy whose training survives a fault under `trainguard run`; see the module docstring.
    Its arguments are DDPStrategy's (`find_unused_parameters`, `broadcast_buffers`, ...), less the cluster
    environment and start method, which are the job's."""

    def __init__(self, **kwargs):
        super().__init__(cluster_environment=JobEnvironment(), **self._join_job(kwargs))

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _setup_model(self, model: torch.nn.Module) -> DataParallel:
        device_ids = self.determine_ddp_device_ids()
        return DataParallel(model, device_ids=device_ids, **self._ddp_kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Gradient accumulation: no exchange until the batch whose backward is followed by the update."""
        if isinstance(self.model, DataParallel):
            with self.model.no_sync():
                yield
        else:
            yield

    def teardown(self) -> None:
        if isinstance(self.model, DataParallel):
            self.model = self.lightning_module
        super().teardown()


DDPStrategy = Strategy  # the name a port may import instead of Lightning's


class ModelParallelStrategy(_JobStrategy, lightning_strategies.ModelParallelStrategy):
    """Lightning's model-parallel strategy (FSDP2 and tensor parallelism applied in `configure_model()`, with
    `self.device_mesh`) whose training survives a fault under `trainguard run`: a port imports it from here instead of
    `lightning.pytorch.strategies`. The mesh is the job's, and the model the one `configure_model()` sharded
    (trainguard's sharded engine: train/parallel/sharding.py); the rest is as `Strategy`'s. Its arguments are
    Lightning's (`data_parallel_size`, `tensor_parallel_size`, `save_distributed_checkpoint`, ...)."""

    def __init__(self, **kwargs):
        super().__init__(**self._join_job(kwargs))
        self.cluster_environment = JobEnvironment()

    def setup_environment(self) -> None:
        super().setup_environment()
        sharding.keep_mesh(self.device_mesh)  # the job's mesh: the sharded engine's layout

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        sharding.note(self.model)  # sharded by configure_model() with torch's calls: the job's model
        super().setup_optimizers(trainer)


class _PassEnd(pl.Callback):
    """The training loader's pass ends where Lightning's epoch does: its loop counts the batches, so the loader's
    iterator never runs to its end (train/data/loaders.end_pass)."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.strategy.train_loader is not None:
            loaders.end_pass(self.strategy.train_loader)


def set_epoch(loader, epoch: int) -> None:
    """As Lightning sets a loader's sampler epoch before each pass."""
    for name in ("sampler", "batch_sampler"):
        sampler = getattr(loader, name, None)
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)
