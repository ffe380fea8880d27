"""Disk checkpoints of a running job: when to save, where, how many to keep, what can be restored.

`ModelCheckpoint(prefix, directory, config)` is both a callback (it saves every
`save_checkpoint_steps` steps or `save_checkpoint_seconds` seconds) and the session's disk
source during recovery. Each rank writes its own folder tree `directory/rank_{r}/`, one
checkpoint folder `{prefix}-{epoch}_{step_in_epoch}` per save. Writes run in a background
thread from the step's snapshot, which is a private copy: the next step cannot change what
is being written. A failed write is reported and never looks complete.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError, ConfigError
from .blob import unpack
from .codec import flatten_state, unflatten_state
from .format import checkpoint_name, list_checkpoints, load_checkpoint, prune_checkpoints, save_checkpoint

log = logging.getLogger("trainguard.checkpoint")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    save_checkpoint_steps: int | None = 1
    save_checkpoint_seconds: float | None = None
    keep_checkpoint_max: int = 5
    async_save: bool = True
    integrated_save: bool = True
    exception_save: bool = False
    append_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.save_checkpoint_steps is not None and self.save_checkpoint_steps < 1:
            raise ConfigError(f"save_checkpoint_steps must be >= 1, got {self.save_checkpoint_steps}")
        if self.save_checkpoint_seconds is not None and self.save_checkpoint_seconds <= 0:
            raise ConfigError(f"save_checkpoint_seconds must be > 0, got {self.save_checkpoint_seconds}")
        if self.keep_checkpoint_max < 1:
            raise ConfigError(f"keep_checkpoint_max must be >= 1, got {self.keep_checkpoint_max}")
        if self.keep_checkpoint_max < 2:
            warnings.warn("keep_checkpoint_max < 2: if a save fails or a process dies mid-save, no earlier "
                          "checkpoint is left to fall back on; use at least 2", stacklevel=3)


def _seed_name(progress: dict, steps_per_epoch: int | None) -> tuple[int, int]:
    """(epoch, step in epoch) of the step just completed, 1-based, as MindSpore names checkpoints."""
    epoch, in_epoch = progress["epoch"], progress["in_epoch"]
    if in_epoch == 0 and progress["step"] > 0:
        return epoch, steps_per_epoch or progress["step"]
    return epoch + 1, in_epoch


class ModelCheckpoint:
    def __init__(self, prefix: str = "ckpt", directory: str | Path = "checkpoints",
                 config: CheckpointConfig | None = None):
        if not prefix or "/" in prefix or prefix.startswith("."):
            raise ConfigError(f"checkpoint prefix {prefix!r} must be a plain name")
        self.prefix = prefix
        self.root = Path(directory)
        self.config = config or CheckpointConfig()
        self._rank: int | None = None
        self._last_save = time.monotonic()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

    # --- where ----------------------------------------------------------------------------

    @property
    def directory(self) -> Path:
        from .. import runtime

        rank = runtime.current().rank if self._rank is None else self._rank
        return self.root / f"rank_{rank}"

    def complete_steps(self) -> list[int]:
        self.wait()
        return [c.step for c in list_checkpoints(self.directory, self.prefix)]

    def load(self, step: int) -> dict:
        """{"shared": ..., "own": ...} of this rank at `step`, verified; CheckpointCorrupt names the file."""
        for info in reversed(list_checkpoints(self.directory, self.prefix)):
            if info.step == step:
                shards, manifest = load_checkpoint(info.path)
                (tensors,) = shards.values()
                return unflatten_state(tensors, manifest["meta"], copy=False)
        raise CheckpointError(f"no complete checkpoint of step {step} in {self.directory}")

    # --- when -----------------------------------------------------------------------------

    def on_step_end(self, session) -> None:
        cfg = self.config
        due = cfg.save_checkpoint_steps is not None and session.step % cfg.save_checkpoint_steps == 0
        due = due or (cfg.save_checkpoint_seconds is not None
                      and time.monotonic() - self._last_save >= cfg.save_checkpoint_seconds)
        if due:
            self.save(session)

    def save(self, session) -> None:
        snap = session.snapshots.get(session.step)
        if snap is None:
            session._snapshot()
            snap = session.snapshots.get(session.step)
        self._rank = session.rt.rank
        obj = {"shared": unflatten_state(snap.tensors, snap.meta, copy=False), "own": unpack(snap.own)}
        tensors, meta = flatten_state(obj, copy=False)
        progress = obj["own"]["progress"]
        folder = self.directory / checkpoint_name(self.prefix, *_seed_name(progress, session.steps_per_epoch))
        job = dict(folder=folder, shards={f"rank_{self._rank}.safetensors": tensors}, meta=meta,
                   step=progress["step"], epoch=progress["epoch"], world_size=session.rt.world_size,
                   append_info=dict(self.config.append_info))
        self.wait()
        self._last_save = time.monotonic()
        if self.config.async_save:
            self._thread = threading.Thread(target=self._write, kwargs=job, name="trainguard-ckpt", daemon=True)
            self._thread.start()
        else:
            self._write(**job)

    def _write(self, **job) -> None:
        try:
            save_checkpoint(job.pop("folder"), job.pop("shards"), **job)
            prune_checkpoints(self.directory, self.prefix, self.config.keep_checkpoint_max)
        except (CheckpointError, OSError) as exc:
            self.errors.append(str(exc))
            log.error("checkpoint of step %s failed, training goes on: %s", job.get("step"), exc)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def on_train_end(self, session) -> None:
        self.wait()
