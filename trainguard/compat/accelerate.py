"""Hugging Face Accelerate under trainguard: `from trainguard.compat.accelerate import Accelerator, start_epoch`.

An Accelerate script changes two lines: the import of `Accelerator`, and its epoch loop, which starts where the job
is (`for epoch in range(start_epoch(starting_epoch), num_epochs)`). Everything else stays Accelerate's:
`prepare`, `accumulate`, `backward`, `clip_grad_norm_`, `gather_for_metrics`, `save_state`, its prepared loaders,
its LR scheduler wrapper. Its `init_process_group` joins trainguard's group (worker/pginit.py).

What `prepare` does differently, and why:
- **the model** is wrapped in trainguard's `DDP` where Accelerate would wrap it in torch's (on CPU and GPU data
  parallelism): the gradient exchange that commits or skips a step, and is rebuilt for each generation;
- **the optimizer** is wrapped in `trainguard.Optimizer` inside Accelerate's `AcceleratedOptimizer`, so the commit
  point is the real update (Accelerate calls it only at the end of a gradient-accumulation cycle). The LR scheduler,
  bound to the script's optimizer, is found and kept with the state (train/state/discover.py);
- **each loader** stays Accelerate's (sharding, padding, `gather_for_metrics`' remainder, end-of-loader
  accumulation), wrapped in a `ReplayedLoader` (train/data/replayed.py): the training loader resumes by making its
  pass again from the sampler generator's state and pass count at the pass's start, and reading it up to the
  committed batch.

Accelerate's own counters agree with a resumed position: its accumulation counter restarts at every loader's end and
is at a multiple of the accumulation steps at every commit. Not covered: `elastic` (Accelerate shards over a fixed
world), random draws in loader workers (`num_workers > 0` with random transforms), DeepSpeed, Megatron and Accelerate's
FSDP plugin.
"""

from __future__ import annotations

import contextlib
import os

import accelerate
import torch

from ..errors import ConfigError
from ..train.data.replayed import PassStarts, ReplayedLoader
from ..train.engine.guard import register_state
from ..train.engine.optimizer import Optimizer
from ..train.engine.resume import restored, start_batch, start_epoch, start_step
from ..train.parallel.ddp import DataParallel

__all__ = ["Accelerator", "start_batch", "start_epoch", "start_step"]


def _capture(loader) -> dict:
    """A prepared loader's state that decides its next pass: its pass count and its sampler generator's state."""
    state = {"iteration": int(loader.iteration)}
    generator = getattr(loader, "synchronized_generator", None)
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def _apply(loader, state: dict) -> None:
    loader.set_epoch(int(state["iteration"]))
    generator = getattr(loader, "synchronized_generator", None)
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])


class _SaveCount:
    """Accelerate's count of its automatically named saves (`checkpoint_<n>`), kept with the job's state: a run of
    the script after a fault names its next save as the run without one did (a new Accelerator counts from 0, and
    Accelerate refuses a folder that exists: the job ended with exit 78)."""

    def __init__(self, config) -> None:
        self.config = config

    def state_dict(self) -> dict:
        return {"iteration": int(self.config.iteration)}

    def load_state_dict(self, state: dict) -> None:
        self.config.iteration = int(state["iteration"])


@contextlib.contextmanager
def _trainguard_ddp():
    """Accelerate builds torch's DistributedDataParallel by name: for the call, the name is trainguard's DDP."""
    parallel = torch.nn.parallel
    original = parallel.DistributedDataParallel
    parallel.DistributedDataParallel = DataParallel
    try:
        yield
    finally:
        parallel.DistributedDataParallel = original


class Accelerator(accelerate.Accelerator):
    """Accelerate's Accelerator whose prepared objects survive a fault under `trainguard run`; see the module
    docstring."""

    def __init__(self, *args, **kwargs):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and len(args) < 5 and not kwargs.get("cpu") and not torch.cuda.is_available():
            kwargs["cpu"] = True  # as `accelerate launch --cpu`: without it, Accelerate trains each rank alone on CPU
        super().__init__(*args, **kwargs)
        if self.num_processes != world:
            raise ConfigError(f"Accelerate sees {self.num_processes} process(es), but this trainguard job has {world} "
                              f"workers (Accelerate's distributed type: {self.distributed_type}); on a machine "
                              "without a GPU give Accelerator(cpu=True)")
        # a run of the script after a rewind: the loaders of the run left behind are in no pass (GradientState is
        # a process-wide singleton, and their passes never ended)
        self.gradient_state.dataloader_references = [None]
        self.loader_starts = PassStarts(_capture, _apply)
        self.checkpointed = 0  # objects given to register_for_checkpointing
        self.per_use = False  # inside loaders_per_use()
        register_state("accelerate:loaders", self.loader_starts)
        register_state("accelerate:saves", _SaveCount(self.project_configuration))

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs):
        """Accelerate's. An automatically named save whose folder exists after a restore is the job's own, made before
        a fault took the job back past it: it is made again in that folder (Accelerate would refuse it), as the run
        without a fault made it. Outside a restore, an existing folder is still Accelerate's error."""
        config = self.project_configuration
        folder = os.path.join(self.project_dir or "", "checkpoints", f"checkpoint_{self.save_iteration}")
        if not (config.automatic_checkpoint_naming and os.path.exists(folder) and restored()):
            return super().save_state(output_dir, safe_serialization, **kwargs)
        config.automatic_checkpoint_naming = False  # the older saves were already rotated out before this one
        try:
            return super().save_state(folder, safe_serialization, **kwargs)
        finally:
            config.automatic_checkpoint_naming = True

    def register_for_checkpointing(self, *objects):
        """Accelerate's `save_state` keeps these; trainguard keeps them with the job's state too (named by their order,
        the same in every run of the script)."""
        for obj in objects:
            self.checkpointed += 1
            register_state(f"accelerate:custom:{self.checkpointed}", obj)
        return super().register_for_checkpointing(*objects)

    def prepare_model(self, model: torch.nn.Module, device_placement=None, evaluation_mode: bool = False):
        with _trainguard_ddp():
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def prepare_optimizer(self, optimizer, device_placement=None):
        if not isinstance(optimizer, Optimizer):
            optimizer = Optimizer(optimizer)
        return super().prepare_optimizer(optimizer, device_placement=device_placement)

    def prepare_scheduler(self, scheduler):
        prepared = super().prepare_scheduler(scheduler)
        # Accelerate pairs a scheduler with its prepared optimizer by the optimizer it wraps, which is now
        # trainguard's wrapper of the script's optimizer: pair them here
        bound = getattr(scheduler, "optimizer", None)
        mine = [opt for opt in self._optimizers
                if isinstance(opt.optimizer, Optimizer) and opt.optimizer.optimizer is bound]
        if mine:
            prepared.optimizers = mine
        return prepared

    @contextlib.contextmanager
    def loaders_per_use(self):
        """Loaders prepared inside are made anew for each use (the transformers Trainer makes one per evaluation). A
        run of the script after a fault makes them at other places of its count of loaders, where a kept pass state
        would go to another loader than the one it was taken from; so theirs are not kept: each begins fresh, as it
        does in every run."""
        before, self.per_use = self.per_use, True
        try:
            yield
        finally:
            self.per_use = before

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if isinstance(data_loader, ReplayedLoader):
            return data_loader
        inner = super().prepare_data_loader(data_loader, device_placement=device_placement,
                                            slice_fn_for_dispatch=slice_fn_for_dispatch)
        return ReplayedLoader(inner, PassStarts(_capture, _apply) if self.per_use else self.loader_starts)

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        if isinstance(dataloader, ReplayedLoader):
            return ReplayedLoader(super().skip_first_batches(dataloader.inner, num_batches), self.loader_starts)
        return super().skip_first_batches(dataloader, num_batches)

    def unwrap_model(self, model, *args, **kwargs):
        if isinstance(model, DataParallel):
            model = model.module
        return super().unwrap_model(model, *args, **kwargs)
