"""What a training job must get back after a failure, and how to take and give it.

`TrainState` names the objects; `capture_shared`/`load_shared` cover what data-parallel ranks
hold in common (model, optimizer, LR scheduler, extras) and `capture_rng`/`load_rng` what is
each rank's own (Python, NumPy, torch and CUDA random states).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn


@dataclass(kw_only=True)
class TrainState:
    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None  # torch.optim.lr_scheduler.LRScheduler or anything with state_dict()
    loader: torch.utils.data.DataLoader | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # more objects with state_dict()/load_state_dict()

    def capture_shared(self) -> dict:
        out: dict[str, Any] = {"model": self.model.state_dict()}
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer.state_dict()
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        if self.extra:
            out["extra"] = {k: v.state_dict() for k, v in self.extra.items()}
        return out

    def load_shared(self, shared: dict) -> None:
        self.model.load_state_dict(shared["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(shared["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(shared["scheduler"])
        for k, v in self.extra.items():
            v.load_state_dict(shared["extra"][k])


def capture_rng() -> dict:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def load_rng(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))
