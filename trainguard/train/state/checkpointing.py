"""Disk checkpoints of a running job: when to save, where, how many to keep, what can be restored.

`ModelCheckpoint(prefix, directory, config)` is both a callback (it saves every
`save_checkpoint_steps` steps or `save_checkpoint_seconds` seconds) and the session's disk
source during recovery. Every rank writes into the same folder per save,
`directory/{prefix}-{epoch}_{step_in_epoch}/`: its own `rank_R.safetensors`, and rank 0 writes
the manifest once every rank's file is there (jobsave.py). So `directory` must be shared by
every rank: one host, or a shared filesystem. Writes run in a background thread from the step's
snapshot, which is a private copy: the next step cannot change what is being written. A failed
write is reported (stderr and a `checkpoint_failed` event) and never looks complete.

Dying-gasp checkpoints (a graceful exit on a signal, or the dump recover strategy): a
ModelCheckpoint with `CheckpointConfig(exception_save=True)` also writes one when the job
stops, and `ExceptionCheckpoint` writes only those. Either is a disk source for the next run.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ...checkpoint import jobsave
from ...checkpoint.blob import unpack
from ...checkpoint.format import checkpoint_name, new_manifest
from ...checkpoint.manifest import Kind
from ...checkpoint.retention import list_checkpoints, prune_checkpoints
from ...errors import CheckpointError, ConfigError
from ...worker import runtime as rt_mod
from .shardckpt import ShardedSaver

log = logging.getLogger("trainguard.checkpoint")

SETTLE_PATIENCE_S = 1.0  # how long a recovery lets a save still waiting for its peers go on
EXIT_PATIENCE_S = 10.0  # how long a process leaving normally lets its last save wait for its peers


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    save_checkpoint_steps: int | None = 1
    save_checkpoint_seconds: float | None = None
    keep_checkpoint_max: int = 5
    async_save: bool = True
    integrated_save: bool = True
    exception_save: bool = False  # also save a dying-gasp checkpoint when the job stops (train/engine/graceful.py)
    append_info: dict = field(default_factory=dict)
    commit_timeout_seconds: float = 300.0  # how long rank 0 waits for the other ranks' files of one save

    def __post_init__(self) -> None:
        if self.save_checkpoint_steps is not None and self.save_checkpoint_steps < 1:
            raise ConfigError(f"save_checkpoint_steps must be >= 1, got {self.save_checkpoint_steps}")
        if self.save_checkpoint_seconds is not None and self.save_checkpoint_seconds <= 0:
            raise ConfigError(f"save_checkpoint_seconds must be > 0, got {self.save_checkpoint_seconds}")
        if self.keep_checkpoint_max < 1:
            raise ConfigError(f"keep_checkpoint_max must be >= 1, got {self.keep_checkpoint_max}")
        if self.commit_timeout_seconds <= 0:
            raise ConfigError(f"commit_timeout_seconds must be > 0, got {self.commit_timeout_seconds}")
        if self.keep_checkpoint_max < 2:
            warnings.warn("keep_checkpoint_max < 2: if a save fails or a process dies mid-save, no earlier "
                          "checkpoint is left to fall back on; use at least 2", stacklevel=3)


def _seed_name(progress: dict, steps_per_epoch: int | None) -> tuple[int, int]:
    """(epoch, step in epoch) of the step just completed, 1-based, as MindSpore names checkpoints."""
    epoch, in_epoch = progress["epoch"], progress["in_epoch"]
    if in_epoch == 0 and progress["step"] > 0:
        return epoch, steps_per_epoch or progress["step"]
    return epoch + 1, in_epoch


@dataclass(slots=True)
class _Save:
    """One rank's part of one save, and what its committer needs."""
    folder: Path
    rank: int
    step: int
    epoch: int
    world_size: int
    tensors: dict
    meta: dict
    blobs: dict  # every rank's own state blob at this step
    sid: str
    started: float = field(default_factory=time.monotonic)  # for the event: how long the save took

    @property
    def tmp(self) -> Path:
        return jobsave.temp_for(self.folder, self.step, self.sid)


def when_main_thread_ends(func, *args) -> None:
    """Run func(*args) when the main thread ends, before the interpreter refuses new work to
    threads (threading's own exit hooks run before atexit's; fall back to atexit)."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(func, *args)
    else:
        register(func, *args)


class ModelCheckpoint:
    collective = False  # each rank writes its own part: a dump after a fault can write too

    def __init__(self, prefix: str = "ckpt", directory: str | Path = "checkpoints",
                 config: CheckpointConfig | None = None):
        if not prefix or "/" in prefix or prefix.startswith("."):
            raise ConfigError(f"checkpoint prefix {prefix!r} must be a plain name")
        self.prefix = prefix
        self.root = Path(directory)
        self.config = config or CheckpointConfig()
        self._last_save = time.monotonic()
        self._writer = jobsave.Waiter()
        self._gasp_commits: list[_Save] = []
        self._events = None
        self._exit_hook = False
        self._siblings: list[ModelCheckpoint] = []  # others writing the same folders (see DiskSources)
        self.errors: list[str] = []

    # --- where ----------------------------------------------------------------------------

    @property
    def directory(self) -> Path:
        """Where the checkpoint folders are: shared by every rank."""
        return self.root

    def _complete(self, world_size: int) -> list:
        return [c for c in list_checkpoints(self.root, self.prefix) if c.kind is Kind.JOB and c.world_size == world_size]

    def complete_steps(self) -> list[int]:
        """Steps this job (its world size) can restore from disk. A save still waiting for a peer
        (which may have died) gets SETTLE_PATIENCE_S more, then is left incomplete."""
        self.settle(SETTLE_PATIENCE_S)
        return [c.step for c in self._complete(rt_mod.current().world_size)]

    def load(self, step: int) -> tuple[dict, Path]:
        """({"shared": ..., "own": ...} of this rank at `step`, verified, and its folder); CheckpointCorrupt names
        the file. A missing or corrupt file of this rank is read from a bit-identical replica, and rewritten."""
        rt = rt_mod.current()
        for info in reversed(self._complete(rt.world_size)):
            if info.step == step:
                state, source = jobsave.load_rank(info.path, rt.rank, rt.world_size)
                if source != jobsave.rank_file(rt.rank):
                    self._emit("checkpoint_repaired", rank=rt.rank, step=step, folder=str(info.path),
                               file=jobsave.rank_file(rt.rank), replica=source)
                return state, info.path
        raise CheckpointError(f"no complete checkpoint of step {step} for {rt.world_size} ranks in {self.root}")

    # --- when -----------------------------------------------------------------------------

    def on_step_end(self, session) -> None:
        cfg = self.config
        due = cfg.save_checkpoint_steps is not None and session.step % cfg.save_checkpoint_steps == 0
        if cfg.save_checkpoint_seconds is not None:
            # each rank's clock says something else: the ranks agree (one small all-reduce at the
            # commit point; a failure there fails the step), so every rank saves the same steps
            from ...worker.transfer import all_max

            late = time.monotonic() - self._last_save >= cfg.save_checkpoint_seconds
            due = bool(all_max(int(late), session.rt.group)) or due
        if due:
            self.save(session)

    def save(self, session) -> None:
        snap = session.capture()  # the private copy is all an async save blocks on
        if not self._exit_hook:  # a process leaving normally lets its last save finish
            self._exit_hook = True
            when_main_thread_ends(self.settle, EXIT_PATIENCE_S)
        self._events = getattr(session.rt, "events", None)
        job = self._job(snap, session.rt.rank, session.steps_per_epoch, session.rt.world_size)
        self._writer.settle(None)  # back-pressure: one save at a time
        self._last_save = time.monotonic()
        if self._already_saved(job):
            return
        if self.config.async_save:
            self._writer.start(self._write, job=job)
        else:
            self._write(job)

    def _job(self, snap, rank: int, steps_per_epoch: int | None, world_size: int) -> _Save:
        """What writing `rank`'s part of `snap` takes; the other ranks compute the same folder and id."""
        blobs = dict(snap.ranks) if snap.ranks is not None else {rank: snap.own} if world_size == 1 else None
        if blobs is None or len(blobs) != world_size:
            raise CheckpointError(f"step {snap.step} was not replicated to every rank, so no checkpoint of it "
                                  "can be completed")
        progress = unpack(blobs[rank], f"rank {rank}'s state")["progress"]
        name = checkpoint_name(self.prefix, *_seed_name(progress, steps_per_epoch))
        return _Save(self.root / name, rank, progress["step"], progress["epoch"], world_size, snap.tensors,
                     snap.meta, blobs, jobsave.save_id(name, progress["step"], blobs))

    def _already_saved(self, job: _Save) -> bool:
        return any(c.step == job.step and c.path == job.folder for c in self._complete(job.world_size))

    def _commit(self, job: _Save, timeout: float) -> Path:
        ranks = jobsave.ranks_entry(job.blobs)
        manifest = new_manifest(job.folder, meta={}, step=job.step, epoch=job.epoch, world_size=job.world_size,
                                append_info=dict(self.config.append_info), ranks=ranks)
        folder = jobsave.commit(job.folder, job.step, job.sid, manifest, timeout=timeout,
                                give_up=self._writer.give_up)
        prune_checkpoints(self.root, self.prefix, self.config.keep_checkpoint_max)
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        self._emit("checkpoint_saved", step=job.step, folder=str(folder), world_size=job.world_size,
                   seconds=round(time.monotonic() - job.started, 4), bytes=size)
        return folder

    def _write(self, job: _Save) -> None:
        try:
            jobsave.write_part(job.tmp, job.rank, job.step, job.tensors, job.meta, job.sid)
            if job.rank == 0:  # the writer of rank 0's part commits
                self._commit(job, self.config.commit_timeout_seconds)
        except (CheckpointError, OSError) as exc:
            self._failed(job, exc)

    def _failed(self, job: _Save, exc: BaseException) -> None:
        self.errors.append(str(exc))
        log.error("checkpoint of step %s failed, training goes on: %s", job.step, exc)
        print(f"trainguard: rank {job.rank}: checkpoint of step {job.step} failed, training goes on: {exc}",
              file=sys.stderr, flush=True)
        self._emit("checkpoint_failed", rank=job.rank, step=job.step, error=str(exc)[-500:])

    def _emit(self, event: str, **fields) -> None:
        events = self._events
        if events is None:
            rt = rt_mod.active()
            if rt is None:  # no runtime (a test, a tool): the log line is the report
                return
            events = rt.events
        events.emit(event, **fields)

    def settle(self, patience: float | None = None) -> None:
        """Wait for the save in flight here and in siblings; a commit still waiting for peers gives
        up after `patience` seconds (None: its own timeout)."""
        for writer in (self._writer, *(s.writer for s in self._siblings)):
            writer.settle(patience)

    def wait(self) -> None:
        self.settle(None)

    @property
    def writer(self) -> jobsave.Waiter:
        """The background writer of this saver's checkpoints."""
        return self._writer

    def add_sibling(self, other: "ModelCheckpoint") -> None:
        """`other` writes the same folders: settle() and wait() wait for its saves too."""
        self._siblings.append(other)

    def on_train_end(self, session) -> None:
        self.wait()

    # --- dying gasp ------------------------------------------------------------------------

    @property
    def saves_dying_gasp(self) -> bool:
        return self.config.exception_save

    def save_dying_gasp(self, snap, rank: int, own: bytes, steps_per_epoch: int | None,
                        world_size: int) -> Path | None:
        """Write `rank`'s part of `snap` now, in this thread; None if that step is complete on disk
        already. The part of rank 0 makes this process its committer: `commit_dying_gasp` then
        finishes it. Raises CheckpointError; a cut write never looks complete."""
        job = self._job(snap, rank, steps_per_epoch, world_size)
        # a regular save of this very step may have written this part already, its commit still waiting for a
        # peer: rewriting it would pull its done marker from under that commit
        if self._already_saved(job) or (rank != 0 and jobsave.part_done(job.tmp, rank, job.sid)):
            return None
        jobsave.write_part(job.tmp, rank, job.step, job.tensors, job.meta, job.sid)
        if rank == 0:
            self._gasp_commits.append(job)
        return job.folder

    def commit_dying_gasp(self, deadline: float) -> tuple[list[Path], list[str]]:
        """Commit the dying-gasp saves this process wrote rank 0's part of, waiting for the other
        ranks' parts until `deadline` (time.monotonic()); (folders done, errors)."""
        done, errors = [], []
        while self._gasp_commits:
            job = self._gasp_commits.pop(0)
            try:
                done.append(self._commit(job, max(0.1, deadline - time.monotonic())))
            except (CheckpointError, OSError) as exc:
                errors.append(str(exc))
                log.error("dying-gasp checkpoint of step %d not completed: %s", job.step, exc)
        return done, errors


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
    """The distinct disk sources among `candidates` (ModelCheckpoints by directory and prefix, and the sliced
    checkpoints of a sharded job, train/state/shardckpt.py): where a session finds complete steps on disk and
    loads one, whichever of them holds it."""

    def __init__(self, *candidates):
        unique: dict[tuple, object] = {}
        for c in candidates:
            if isinstance(c, ModelCheckpoint):
                key = (c.root.resolve(), c.prefix)
                if key in unique and unique[key] is not c:
                    c.add_sibling(unique[key])  # settle/wait covers the one it replaces
                unique[key] = c
            elif isinstance(c, ShardedSaver):
                unique[(id(c),)] = c
        super().__init__(unique.values())

    def complete_steps(self) -> list[int]:
        return sorted({s for src in self for s in src.complete_steps()})

    def load(self, step: int) -> tuple[dict, Path]:
        """This rank's state at `step` ({"shared": ..., "own": ...}) and the folder it came from."""
        errors = []
        for src in self:
            try:
                return src.load(step)
            except CheckpointError as exc:
                errors.append(str(exc))
        raise CheckpointError("; ".join(errors) or f"no disk checkpoint source holds step {step}")
