"""What a training job must get back after a failure, and how to take and give it.

`TrainState` names the objects; `capture_shared`/`load_shared` cover what data-parallel ranks
hold in common (model, optimizer, LR scheduler, extras). With a sharded model (`sharded`: FSDP2,
HSDP, DP x TP) the model and optimizer are this rank's part instead, as local tensors
(train/state/shardstate.py), and the rest is as before. Nothing is each rank's own: the random
streams are keyed by (job seed, rank, a point of the step) (train/state/streams.py).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...errors import CheckpointCorrupt, ConfigError
from . import shardstate
from .streams import SEED_RANGE


@dataclass(kw_only=True)
class TrainState:
    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None  # torch.optim.lr_scheduler.LRScheduler or anything with state_dict()
    loader: torch.utils.data.DataLoader | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # more objects with state_dict()/load_state_dict()
    sharded: bool = False  # the model holds DTensors: model and optimizer are this rank's part (train/parallel/sharding.py)

    def net(self) -> nn.Module:
        """The model whose state is kept: a data-parallel wrapper's net (the same keys with and without it)."""
        return getattr(self.model, "unwrapped", self.model)

    def capture_shared(self, at: dict | None = None) -> dict:
        """The objects' states; the tensors are the live ones (a caller that keeps them copies them). `at`: the
        `hyperparameters()` of the position being captured, where the script has moved them on since."""
        if self.sharded:
            out: dict[str, Any] = {"part": shardstate.capture(self.model, self.optimizer, copy=False)}
        else:  # no model: its parameters are a registered module's (an extra)
            out = {"model": self.net().state_dict()} if self.model is not None else {}
            if self.optimizer is not None:
                out["optimizer"] = self.optimizer.state_dict()
                if at is not None:
                    groups = out["optimizer"]["param_groups"]
                    out["optimizer"]["param_groups"] = [{**g, **saved} for g, saved in zip(groups, at["groups"])]
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict() if at is None else at["scheduler"]
        if self.extra:
            out["extra"] = {k: v.state_dict() for k, v in self.extra.items()} if at is None else at["extra"]
        return out

    def hyperparameters(self, light: bool = False) -> dict:
        """A copy of what the script's code between steps moves: the param groups' values (the LR), the scheduler's
        and the extras' states (not the tensors of the model and the optimizer, which only a commit changes).
        `light` (taken at every step): an extra's tensor of more than LIGHT_NUMEL elements (an EMA's weights, which
        the code after the update moves) is kept as it is, not copied."""
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        take = _light if light else copy.deepcopy
        return {"groups": [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in groups],
                "scheduler": copy.deepcopy(self.scheduler.state_dict()) if self.scheduler is not None else None,
                "extra": {k: take(v.state_dict()) for k, v in self.extra.items()}}

    def put_back(self, saved: dict) -> None:
        """Set what `hyperparameters()` copied."""
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        for group, values in zip(groups, saved["groups"]):
            group.update(values)
        if saved["scheduler"] is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        for k, v in self.extra.items():
            v.load_state_dict(saved["extra"][k])

    def load_shared(self, shared: dict) -> None:
        if self.sharded != ("part" in shared):
            raise ConfigError("this state was saved by a " + ("data-parallel" if self.sharded else "sharded") +
                              " run and this run's model is " + ("sharded" if self.sharded else "not sharded") +
                              ": resume it with the layout that saved it, or start without its checkpoints")
        if self.sharded:
            shardstate.load(self.model, self.optimizer, shared["part"])
        else:
            if self.model is not None:
                self.net().load_state_dict(shared["model"])
            if self.optimizer is not None:
                self.optimizer.load_state_dict(shared["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(shared["scheduler"])
        saved = shared.get("extra", {})
        missing = sorted(set(self.extra) - set(saved))
        if missing:
            raise ConfigError(f"the state to restore holds nothing for {', '.join(missing)}, which this run has: the "
                              "script must make the same objects on every rank and in every run (a checkpoint must "
                              "come from the same script)")
        for k, v in self.extra.items():
            v.load_state_dict(saved[k])


LIGHT_NUMEL = 1 << 16


def _light(value):
    """A copy of `value` whose tensors above LIGHT_NUMEL elements are the same tensors (pure but for the copies)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone() if value.numel() <= LIGHT_NUMEL else value
    if type(value) in (dict, OrderedDict):  # a module's state_dict() is an OrderedDict with its `_metadata`
        out = type(value)((k, _light(v)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            out._metadata = copy.deepcopy(value._metadata)
        return out
    if type(value) in (list, tuple):
        return type(value)(_light(v) for v in value)
    return copy.deepcopy(value)


def job_seed() -> int:
    """This process's candidate for the job's seed: what the script seeded torch with (or torch's own)."""
    return torch.initial_seed() % SEED_RANGE


def bounded(own: dict, key: str, limit: int, default):
    """`own[key]` of a restored state (untrusted: a peer's, a checkpoint's): an int in 0..limit-1, else
    CheckpointCorrupt; `default` where it is absent."""
    value = own.get(key, default)
    if value is not default and (type(value) is not int or not 0 <= value < limit):
        raise CheckpointCorrupt(f"the restored state's {key!r} must be an int in 0..{limit - 1}, got {value!r}")
    return value
