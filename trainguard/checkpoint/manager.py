"""Disk checkpoints of a running job: when to save, where, how many to keep, what can be restored.

`ModelCheckpoint(prefix, directory, config)` is both a callback (it saves every
`save_checkpoint_steps` steps or `save_checkpoint_seconds` seconds) and the session's disk
source during recovery. Each rank writes its own folder tree `directory/rank_{r}/`, one
checkpoint folder `{prefix}-{epoch}_{step_in_epoch}` per save. Writes run in a background
thread from the step's snapshot, which is a private copy: the next step cannot change what
is being written. A failed write is reported and never looks complete.

Dying-gasp checkpoints (a graceful exit on a signal, or the dump recover strategy): a
ModelCheckpoint with `CheckpointConfig(exception_save=True)` also writes one when the job
stops, and `ExceptionCheckpoint` writes only those. Either is a disk source for the next run.
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
from .format import checkpoint_name, load_checkpoint, save_checkpoint
from .retention import list_checkpoints, prune_checkpoints

log = logging.getLogger("trainguard.checkpoint")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    save_checkpoint_steps: int | None = 1
    save_checkpoint_seconds: float | None = None
    keep_checkpoint_max: int = 5
    async_save: bool = True
    integrated_save: bool = True
    exception_save: bool = False  # also save a dying-gasp checkpoint when the job stops (train/graceful.py)
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
        job = self._job(snap, self._rank, snap.own, session.steps_per_epoch, session.rt.world_size)
        self.wait()
        self._last_save = time.monotonic()
        if self.config.async_save:
            self._thread = threading.Thread(target=self._write, kwargs=job, name="trainguard-ckpt", daemon=True)
            self._thread.start()
        else:
            self._write(**job)

    def _job(self, snap, rank: int, own: bytes, steps_per_epoch: int | None, world_size: int) -> dict:
        """What save_checkpoint needs to write `rank`'s state at `snap` (own: that rank's own blob)."""
        obj = {"shared": unflatten_state(snap.tensors, snap.meta, copy=False), "own": unpack(own)}
        tensors, meta = flatten_state(obj, copy=False)
        progress = obj["own"]["progress"]
        folder = self.root / f"rank_{rank}" / checkpoint_name(self.prefix, *_seed_name(progress, steps_per_epoch))
        return dict(folder=folder, shards={f"rank_{rank}.safetensors": tensors}, meta=meta,
                    step=progress["step"], epoch=progress["epoch"], world_size=world_size,
                    append_info=dict(self.config.append_info))

    # --- dying gasp ------------------------------------------------------------------------

    @property
    def saves_dying_gasp(self) -> bool:
        return self.config.exception_save

    def save_dying_gasp(self, snap, rank: int, own: bytes, steps_per_epoch: int | None,
                        world_size: int) -> Path | None:
        """Write `rank`'s state at `snap` now, in this thread; None if a complete one is already there.
        Raises CheckpointError; a cut write never looks complete (format.py renames it into place last)."""
        job = self._job(snap, rank, own, steps_per_epoch, world_size)
        folder = job.pop("folder")
        if any(c.step == job["step"] for c in list_checkpoints(folder.parent, self.prefix)):
            return None
        save_checkpoint(folder, job.pop("shards"), **job)
        prune_checkpoints(folder.parent, self.prefix, self.config.keep_checkpoint_max)
        return folder

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


class ExceptionCheckpoint(ModelCheckpoint):
    """Saves only dying-gasp checkpoints (graceful exit, dump), in the seeds' style:

        cb += [ModelCheckpoint("net", "ckpt", config), ExceptionCheckpoint("net", "ckpt", config)]

    With the same prefix and directory as a ModelCheckpoint it writes into the same folders (a
    step already saved is not written twice), and the next run restores from either."""

    @property
    def saves_dying_gasp(self) -> bool:
        return True

    def on_step_end(self, session) -> None:
        return None


class DiskSources(list):
    """The distinct ModelCheckpoints among `candidates` (by directory and prefix): where a session
    finds complete steps on disk and loads one, whichever of them holds it."""

    def __init__(self, *candidates):
        unique = {(c.root.resolve(), c.prefix): c for c in candidates if isinstance(c, ModelCheckpoint)}
        super().__init__(unique.values())

    def complete_steps(self) -> list[int]:
        return sorted({s for src in self for s in src.complete_steps()})

    def load(self, step: int) -> dict:
        errors = []
        for src in self:
            try:
                return src.load(step)
            except CheckpointError as exc:
                errors.append(str(exc))
        raise CheckpointError("; ".join(errors) or f"no disk checkpoint source holds step {step}")
