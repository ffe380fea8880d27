"""`trainguard.Optimizer`: a torch optimizer whose `step()` is the commit point of a hand-written loop (guard.py)."""

from __future__ import annotations

import torch

from ... import rewinding
from ...errors import ConfigError
from ..state.shardckpt import ShardedCheckpoints
from . import guard as guard_mod


class Optimizer:
    """Wraps a torch optimizer: `step()` is the commit point (guard.py's docstring). An LR scheduler
    given here is restored with the rest; it is held, not changed."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, lr_scheduler=None,
                 checkpoints: ShardedCheckpoints | None = None):
        if isinstance(optimizer, Optimizer):
            raise ConfigError("this optimizer is wrapped twice in trainguard.Optimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):  # its state_dict()'s param_groups are the commit's
            raise ConfigError(f"trainguard.Optimizer wraps one torch.optim.Optimizer, not a {type(optimizer).__name__}: "
                              "several optimizers combined in one object (torchrec's CombinedOptimizer, a DLRM's "
                              "SparseAdam beside Adam) are not covered, since trainguard holds one model, one "
                              "optimizer, one update a step; train with one torch optimizer (Adagrad or Adam over "
                              "dense embeddings)")
        if _shards_its_state(optimizer):
            raise ConfigError("trainguard.Optimizer cannot hold a ZeroRedundancyOptimizer: each rank keeps only its "
                              "own slice of the optimizer state, which trainguard neither holds nor can give a "
                              "replacement; wrap its optimizer_class directly (torch.optim.Adam(model.parameters(), "
                              "...)), or shard the model and its optimizer state with trainguard.fully_shard (FSDP2), "
                              "whose slices trainguard keeps and restores")
        for name in ("state_dict", "load_state_dict"):
            if lr_scheduler is not None and not callable(getattr(lr_scheduler, name, None)):
                raise ConfigError(f"lr_scheduler has no {name}(): give a torch LR scheduler or any object with "
                                  "state_dict() and load_state_dict()")
        if checkpoints is not None and not isinstance(checkpoints, ShardedCheckpoints):
            raise ConfigError(f"checkpoints={type(checkpoints).__name__}: give trainguard.ShardedCheckpoints(directory, "
                              "prefix, every=N)")
        self.optimizer = optimizer
        rewinding.wrapped.add(optimizer)  # its steps before the loop are no unported script's (worker/pginit.py)
        self.lr_scheduler = lr_scheduler
        self.checkpoints = checkpoints
        self.guard = guard_mod.install(self)

    def step(self, closure=None):
        return self.guard.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.guard.settle()  # a step skipped past the data: its scheduler step is undone by now (pastend.py)
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def __class__(self):
        """The wrapped optimizer's class, to `isinstance` only (type() stays this one): an LR scheduler made on this
        wrapper, after it, as scripts that wrap the optimizer where they make it do, is accepted (torch's schedulers
        refuse what is not a torch.optim.Optimizer), and is found and held with the rest (discover.py)."""
        return type(self.optimizer)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self):
        self.guard.settle()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, group) -> None:
        self.optimizer.add_param_group(group)

    def __getattr__(self, name: str):  # anything else (defaults, hooks, ...) is the wrapped optimizer's
        if name in ("optimizer", "guard", "lr_scheduler", "checkpoints"):  # not set yet (e.g. a copy under construction)
            raise AttributeError(name)
        return getattr(self.optimizer, name)


def _shards_its_state(optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer  # here: torch.distributed.optim loads rpc's modules
    return isinstance(optimizer, ZeroRedundancyOptimizer)
