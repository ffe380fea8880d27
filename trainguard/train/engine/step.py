"""One step of the loop and the session's configuration.

`with step:` catches what the session can recover from inside the step, classified by type, never
by message text:
  - `CollectiveFailed`: a collective trainguard issued failed (the gradient exchange, raised where
    the optimizer was about to step, so nothing was applied), and torch's own typed `DistError`;
  - with the retry recover strategy, exceptions marked retriable (`trainguard.Retriable`,
    `SessionConfig(retriable=...)`).
Anything else is the user's error and propagates, also after the cluster moved to a new
generation. The session decides what to do at the step's commit point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

from ...errors import CollectiveFailed, ConfigError

_TYPED = (CollectiveFailed, *((dist.DistError,) if hasattr(dist, "DistError") else ()))


def is_collective_failure(exc: BaseException) -> bool:
    """A failed collective: ours (CollectiveFailed) or torch's typed DistError. A plain RuntimeError is
    not one, whatever its text says (a DataLoader timeout is a RuntimeError too)."""
    return isinstance(exc, _TYPED)


@dataclass(kw_only=True, slots=True)
class SessionConfig:
    epochs: int = 1
    max_steps: int | None = None  # stop after this many steps in all (default: epochs x steps per epoch)
    snapshot_every: int = 1  # accepted for compatibility; commit-or-skip takes no snapshots
    keep_snapshots: int = 2  # accepted for compatibility
    agree_timeout: float = 600.0
    retriable: tuple[type[BaseException], ...] = ()  # with the retry strategy these redo the step in process

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ConfigError(f"epochs must be >= 1, got {self.epochs}")
        if self.max_steps is not None and self.max_steps < 0:
            raise ConfigError(f"max_steps must be >= 0, got {self.max_steps}")
        if self.snapshot_every < 1:
            raise ConfigError(f"snapshot_every must be >= 1, got {self.snapshot_every}")
        if self.keep_snapshots < 2:
            raise ConfigError("keep_snapshots must be >= 2 (ranks can be one step apart when a peer dies)")
        self.retriable = tuple(self.retriable)
        if not all(isinstance(t, type) and issubclass(t, BaseException) for t in self.retriable):
            raise ConfigError(f"retriable must be exception classes, got {self.retriable!r}")


class Step:
    """One training step. Use `with step:` around its body so a failed collective is caught."""

    __slots__ = ("retriable", "index", "epoch", "in_epoch", "batch", "failure")

    def __init__(self, retriable: Callable[[BaseException], bool], index: int, epoch: int, in_epoch: int, batch):
        """`retriable(exc)`: whether the session's recover strategy redoes the step after `exc` in process."""
        self.retriable, self.index, self.epoch, self.in_epoch, self.batch = retriable, index, epoch, in_epoch, batch
        self.failure: BaseException | None = None

    def __enter__(self) -> "Step":
        return self

    def __exit__(self, tp, exc, tb) -> bool:
        if exc is None:
            return False
        if is_collective_failure(exc) or self.retriable(exc):
            self.failure = exc
            return True
        return False
