"""Sliced disk checkpoints of a job in the user's own loop (`{prefix}-1_{step}` folders), which resume on another
layout: FSDP2, HSDP, DP x TP, and plain data parallelism (whole tensors, every rank's file a replica).

    optimizer = trainguard.Optimizer(torch.optim.AdamW(model.parameters()), lr_scheduler=sched,
                                     checkpoints=trainguard.ShardedCheckpoints("ckpt", "lm", every=100))

`ShardedCheckpoints` is what the script asks for; `ShardedSaver` is the session's side of it, one of its
disk sources (train/state/checkpointing.py's DiskSources) and a dying-gasp saver:

- every `every` committed steps, and at a graceful stop (SIGTERM), every rank writes the slices it holds
  (`checkpoint/sharded.py`, collective: the ranks reach the same step together); in the user's own loop a
  step is saved when the next one begins (or the script ends), after the code that follows
  `optimizer.step()` (its `scheduler.step()`), which belongs to the step;
- a restore from disk fills the slices of whatever layout the job now has (`checkpoint/reshard.py`): a
  checkpoint written on (dp=2, tp=2) resumes on (dp=1, tp=2). The LR scheduler's and the registered objects'
  states travel in the checkpoint's metadata, the position and the job's seed in its `append_info`.

A save is collective, so it is never a dump after a fault (peers may be dead): the per-rank dying gasp
(TG_CHECKPOINT_DIR) covers that. `resume=False` refuses to start a fresh job over checkpoints of an earlier
run in the same directory rather than mixing them with its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ...checkpoint import list_checkpoints, load_sharded, read_manifest, save_sharded
from ...checkpoint.blob import unpack
from ...checkpoint.manifest import Kind
from ...checkpoint.reshard import init_optimizer_state
from ...checkpoint.retention import prune_checkpoints
from ...control.msgbase import INT64_MAX
from ...errors import CheckpointError, CollectiveFailed, ConfigError
from ..parallel.sharding import stage_of
from . import parallel_strategy, shardstate
from .train_state import TrainState

log = logging.getLogger("trainguard.checkpoint")
PHASE_KEYS = frozenset({"base", "phase_start", "shards"})  # data/phase.py's Phase.as_dict
FAULTS = (CollectiveFailed, *((dist.DistError,) if hasattr(dist, "DistError") else ()))


@dataclass(frozen=True, slots=True)
class ShardedCheckpoints:
    directory: str | Path
    prefix: str = "ckpt"
    every: int = 0  # save every this many steps (0: only the dying gasp)
    integrated: bool = False  # one file of whole tensors instead of slices
    resume: bool = True  # a fresh job goes on from the newest complete one
    keep: int = 0  # how many of the newest are kept (0: all)

    def __post_init__(self) -> None:
        if not str(self.directory):
            raise ConfigError("ShardedCheckpoints needs a directory")
        if not self.prefix or "/" in self.prefix or self.prefix.startswith("."):
            raise ConfigError(f"ShardedCheckpoints(prefix={self.prefix!r}): must be a plain name")
        if self.every < 0 or self.keep < 0:
            raise ConfigError(f"ShardedCheckpoints(every={self.every}, keep={self.keep}): both must be >= 0")

    def folder(self, step: int) -> Path:
        return Path(self.directory, f"{self.prefix}-1_{step}")

    def complete_steps(self) -> list[int]:
        """Steps with a complete sliced (or integrated) checkpoint in the directory, in a folder named for its step."""
        return [c.step for c in list_checkpoints(Path(self.directory), self.prefix)
                if c.kind is Kind.LAYOUT and c.path == self.folder(c.step)]


class ShardedSaver:
    """The session's disk source and dying-gasp saver for `config` (see the module docstring)."""

    collective = True  # every rank saves together: never after a fault

    def __init__(self, config: ShardedCheckpoints, state: TrainState, rt, mesh=None):
        self.config, self.state, self.rt, self.mesh = config, state, rt, mesh  # mesh: the job's whole DeviceMesh
        self.root, self.prefix = Path(config.directory), config.prefix
        self.due: int | None = None  # a committed step to save when the next one begins (the user's own loop)
        self.staged = stage_of(state.net()) is not None  # a pipeline stage: its ranks hold different tensors, saved
        # as their union, the optimizer's state by parameter name (checkpoint/union.py)
        earlier = config.complete_steps()
        if not config.resume and rt.generation <= 1 and earlier:
            raise ConfigError(f"{self.root} holds checkpoints of an earlier run (the newest: step {earlier[-1]}), and "
                              "ShardedCheckpoints(resume=False) starts afresh: resume from them (resume=True, the "
                              "script's --resume), or give an empty directory")

    @property
    def saves_dying_gasp(self) -> bool:
        return True

    # --- a restore ---------------------------------------------------------------------------------

    def complete_steps(self) -> list[int]:
        """Complete checkpoints a trainguard job wrote (a sliced save of the same prefix by other code has no
        training position, and is not a source)."""
        steps = []
        for step in self.config.complete_steps():
            try:
                position(read_manifest(self.config.folder(step)), step)
            except CheckpointError as exc:
                log.warning("%s is not a source for a restore: %s", self.config.folder(step), exc)
                continue
            steps.append(step)
        return steps

    def load(self, step: int) -> tuple[dict, Path]:
        """Fill the model and optimizer from checkpoint `step`, resharded to this layout; returns this rank's
        state as a peer would send it ({"shared": ..., "own": ...}) and the folder."""
        folder = self.config.folder(step)
        if step not in self.config.complete_steps():
            raise CheckpointError(f"no complete checkpoint of step {step} in {self.root} (prefix {self.prefix!r})")
        own = position(read_manifest(folder), step)  # before anything is loaded
        self._say_if_resharded(folder, own["progress"])
        model, optimizer = self.state.net(), self.state.optimizer
        if self.state.sharded:  # the slices this rank holds now, read into its DTensors
            init_optimizer_state(optimizer)  # the optimizer's tensors must exist to be loaded into
            loaded = load_sharded(folder, self._contents(), strict=True, partial=self.staged)
            model.load_state_dict(loaded["model"])
            optimizer.load_state_dict(shardstate.from_names(model, optimizer, loaded["optim"]) if self.staged
                                      else loaded["optim"])
            shared = {"part": shardstate.capture(model, optimizer, copy=False)}
        else:  # data parallel: whole tensors, which the session loads as a peer's state
            loaded = load_sharded(folder)
            shared = {"model": loaded["model"], "optimizer": loaded["optim"]}
        for key, have in (("scheduler", self.state.scheduler is not None), ("extra", bool(self.state.extra))):
            if have and key not in loaded:
                raise CheckpointError(f"{folder} holds no {key} state, which this run has: resume with the script "
                                      "that wrote it, or start without these checkpoints")
            if have:
                shared[key] = loaded[key]
        return {"shared": shared, "own": own}, folder

    def _say_if_resharded(self, folder: Path, progress: dict) -> None:
        if self.rt.rank != 0:
            return
        saved = parallel_strategy.read(self.root)
        if saved is None or saved.get("world_size") == self.rt.world_size:
            return
        before = saved.get("world_size")
        now = parallel_strategy.describe(self.state.model, self.rt.world_size, mesh=self.mesh)
        print(f"trainguard: the device count changed ({before} -> {self.rt.world_size}): resharding {folder.name} "
              f"from {parallel_strategy.mesh_words(saved)} to {parallel_strategy.mesh_words(now)}", flush=True)
        if progress.get("in_epoch", 0) > 0 and not PHASE_KEYS & set(progress):
            print(f"trainguard: warning: {folder.name} is {progress['in_epoch']} batches into epoch "
                  f"{progress['epoch']}, split for {before} ranks. Loaders that split their data over the ranks now "
                  f"split the rest of that epoch for {self.rt.world_size}, so some of its samples may be skipped or "
                  f"seen twice. For an exact continuation resume on {before} ranks, or from a checkpoint at the "
                  "start of an epoch", flush=True)

    # --- saving ------------------------------------------------------------------------------------

    def _contents(self) -> dict:
        """What a checkpoint holds: DTensors as the slices each rank holds, whole tensors otherwise."""
        state = self.state
        optim = shardstate.by_name(state.net(), state.optimizer) if self.staged else state.optimizer.state_dict()
        out = {"model": state.net().state_dict(), "optim": optim}
        if state.scheduler is not None:
            out["scheduler"] = state.scheduler.state_dict()
        if state.extra:
            out["extra"] = {k: v.state_dict() for k, v in state.extra.items()}
        return out

    def save(self, step: int, own: dict) -> Path | None:
        """Collective: every rank writes its slices of committed step `step` (`own`: the position and seed, as
        Session.own gives them). None: that step is complete already (a step trained again after a restore is
        the same step)."""
        if step in self.complete_steps():
            return None
        folder = save_sharded(self.config.folder(step), self._contents(), step=step, epoch=1,
                              integrated=self.config.integrated, partial=self.staged,
                              append_info={"step": step, "seed": own.get("seed"), "own": own})
        if self.config.keep and self.rt.rank == 0:
            prune_checkpoints(self.root, self.prefix, self.config.keep)
        return folder

    def on_step_end(self, session) -> None:
        if not self.config.every or session.step % self.config.every:
            return
        self.due = session.step  # saved when the next step begins: the script's code after optimizer.step() (its
        # scheduler.step()) still belongs to this one. A sharded model runs only in the user's own loop.

    def on_step_begin(self, session, _step=None) -> None:
        self.flush(session)

    def flush(self, session) -> None:
        """Save the step left due at its commit, if the job is still at it (collective)."""
        due, self.due = self.due, None
        if due is not None and due == session.step:
            self.save(session.step, session.own())

    # --- the dying gasp (train/engine/graceful.py) -------------------------------------------------

    def save_dying_gasp(self, snap, rank: int, own: bytes, steps_per_epoch, world_size: int) -> Path | None:
        """Every rank, at the step the job stopped at: the live objects hold it (a stop is voted at a commit)."""
        self.due = None
        try:
            return self.save(snap.step, unpack(own, "this rank's position"))
        except FAULTS as exc:  # a peer was killed meanwhile: the save is cut short and nothing looks complete
            raise CheckpointError(f"the sliced dying-gasp checkpoint of step {snap.step} failed: {exc}") from exc

    def commit_dying_gasp(self, deadline: float) -> tuple[list[Path], list[str]]:
        return [], []  # a sliced save commits itself

    def settle(self, patience: float | None = None) -> None:
        return None  # saves are synchronous


def position(manifest: dict, step: int) -> dict:
    """The training position a checkpoint's manifest records (append_info.own: progress, seed, loader), checked
    as untrusted input: every number an int in range, the step the folder's. CheckpointError names what is wrong."""
    own = (manifest.get("append_info") or {}).get("own") if isinstance(manifest, dict) else None
    where = f"checkpoint of step {step}"
    if not isinstance(own, dict) or not isinstance(own.get("progress"), dict):
        raise CheckpointError(f"the {where} records no training position (append_info.own): it was not written by a "
                              "trainguard job's ShardedCheckpoints")
    progress = own["progress"]
    numbers = {f"progress.{k}": progress.get(k) for k in ("step", "epoch", "in_epoch")}
    numbers.update({k: own.get(k) for k in ("seed", "loader") if own.get(k) is not None})
    for key in PHASE_KEYS & set(progress):  # an elastic data-parallel job's phase within its epoch
        numbers[f"progress.{key}"] = progress[key]
    for name, value in numbers.items():
        if type(value) is not int or not 0 <= value <= INT64_MAX:
            raise CheckpointError(f"the {where} records {name} = {value!r}, not an integer in [0, 2^63): the manifest "
                                  "is damaged or was not written by trainguard")
    if progress["step"] != step:
        raise CheckpointError(f"the {where} records step {progress['step']}: the manifest does not belong to its folder")
    extra = set(progress) - {"step", "epoch", "in_epoch", *PHASE_KEYS}
    if extra:
        raise CheckpointError(f"the {where} records unknown position fields {sorted(extra)[:5]}")
    out = {"progress": dict(progress), "seed": own.get("seed")}
    if own.get("loader") is not None:
        out["loader"] = own["loader"]
    return out
