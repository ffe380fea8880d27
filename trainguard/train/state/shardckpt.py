"""Sliced disk checkpoints of a sharded job (`{prefix}-1_{step}` folders): the last source of a
restore, and the dying gasp of a graceful stop.

A save is collective (every rank writes its slices, `checkpoint/sharded.py`); a load fills the
slices of whatever layout the job now has (`checkpoint/reshard.py`), so a checkpoint written on
(dp=2, tp=2) resumes on (dp=1, tp=2). The manifest's `append_info` carries the step and the job's
seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ...checkpoint import list_checkpoints, load_sharded, read_manifest, save_sharded
from ...checkpoint.reshard import init_optimizer_state
from ...errors import ConfigError


@dataclass(frozen=True, slots=True)
class ShardedCheckpoints:
    directory: str | Path
    prefix: str = "ckpt"
    every: int = 0  # save every this many steps (0: only the dying gasp)
    integrated: bool = False  # one file of whole tensors instead of slices
    resume: bool = True  # a fresh job goes on from the newest complete one

    def __post_init__(self) -> None:
        if not str(self.directory):
            raise ConfigError("ShardedCheckpoints needs a directory")
        if self.every < 0:
            raise ConfigError(f"ShardedCheckpoints(every={self.every}): must be >= 0")

    def folder(self, step: int) -> Path:
        return Path(self.directory, f"{self.prefix}-1_{step}")

    def complete_steps(self) -> list[int]:
        return [c.step for c in list_checkpoints(Path(self.directory), self.prefix)]

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, seed: int | None) -> None:
        """Collective. A folder whose manifest exists is complete and is never written again."""
        folder = self.folder(step)
        if not (folder / "manifest.json").exists():
            save_sharded(folder, train_state(model, optimizer), step=step, epoch=1, integrated=self.integrated,
                         append_info={"step": step, "seed": seed})

    def load(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> int | None:
        """Fill the modules from checkpoint `step`; returns the job seed it recorded (None: older checkpoints)."""
        folder = self.folder(step)
        init_optimizer_state(optimizer)  # the optimizer's tensors must exist to be loaded into
        loaded = load_sharded(folder, train_state(model, optimizer))
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optim"])
        if "rng" in loaded:
            torch.set_rng_state(loaded["rng"])
        seed = (read_manifest(folder).get("append_info") or {}).get("seed")
        return int(seed) if isinstance(seed, int) else None


def train_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What a checkpoint holds: DTensors as the slices each rank holds, whole tensors otherwise."""
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "rng": torch.get_rng_state()}
