"""What a training job must get back after a failure, and how to take and give it.

`TrainState` names the objects; `capture_shared`/`load_shared` cover what data-parallel ranks
hold in common (model, optimizer, LR scheduler, extras). With a sharded model (`sharded`: FSDP2,
HSDP, DP x TP) the model and optimizer are this rank's part instead, as local tensors
(train/state/shardstate.py), and the rest is as before. Nothing is each rank's own: the random
streams are re-seeded at every step from (job seed, rank, step) by `reseed`.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ...errors import ConfigError
from . import shardstate

SEED_RANGE = 1 << 63


@dataclass(kw_only=True)
class TrainState:
    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None  # torch.optim.lr_scheduler.LRScheduler or anything with state_dict()
    loader: torch.utils.data.DataLoader | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # more objects with state_dict()/load_state_dict()
    sharded: bool = False  # the model holds DTensors: model and optimizer are this rank's part (train/parallel/sharding.py)

    def capture_shared(self) -> dict:
        """The objects' states; the tensors are the live ones (a caller that keeps them copies them)."""
        if self.sharded:
            out: dict[str, Any] = {"part": shardstate.capture(self.model, self.optimizer, copy=False)}
        else:
            out = {"model": self.model.state_dict()}
            if self.optimizer is not None:
                out["optimizer"] = self.optimizer.state_dict()
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        if self.extra:
            out["extra"] = {k: v.state_dict() for k, v in self.extra.items()}
        return out

    def load_shared(self, shared: dict) -> None:
        if self.sharded != ("part" in shared):
            raise ConfigError("this state was saved by a " + ("data-parallel" if self.sharded else "sharded") +
                              " run and this run's model is " + ("sharded" if self.sharded else "not sharded") +
                              ": resume it with the layout that saved it, or start without its checkpoints")
        if self.sharded:
            shardstate.load(self.model, self.optimizer, shared["part"])
        else:
            self.model.load_state_dict(shared["model"])
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


def job_seed() -> int:
    """This process's candidate for the job's seed: what the script seeded torch with (or torch's own)."""
    return torch.initial_seed() % SEED_RANGE


def step_seed(seed: int, rank: int, step: int) -> int:
    """The seed of `rank`'s random streams for the step after `step` committed ones (pure)."""
    digest = hashlib.blake2b(f"{seed}:{rank}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_RANGE


def reseed(seed: int | None, rank: int, step: int) -> None:
    """Seed Python's, NumPy's, torch's (and CUDA's) global random streams for the next step, so that a
    rank's randomness at step s is known without saving it: a replacement, a lagging rank and a rerun
    all draw what an uninterrupted run draws. About 15 us."""
    if seed is None:
        return
    seed_streams(step_seed(seed, rank, step))


def seed_streams(s: int) -> None:
    """Seed Python's, NumPy's, torch's (and CUDA's, once initialised) global random streams with `s`."""
    random.seed(s)
    np.random.seed(s % (1 << 32))
    torch.default_generator.manual_seed(s)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed(s)
