"""Live recovery for sharded layouts (FSDP2, HSDP, DP x TP) in a hand-written loop.

    def build(mesh):                                     # called at the start and after every regroup
        model = Net(); fully_shard(model, mesh=mesh)     # or parallelize_module(..., mesh["tp"], plan)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    job = trainguard.ShardedJob(build, trainguard.MeshSpec((2, 2), ("dp", "tp"), replicate=("dp",)),
                                max_steps=1000, checkpoints=trainguard.ShardedCheckpoints("ckpt", every=100))
    for step in job.steps():                             # step.number: the step being trained (1, 2, ...)
        with step:                                       # catches a failed collective
            loss = loss_fn(job.model(batch(step.number)))
            loss.backward()
            job.optimizer.step()                         # the commit point

The same commit-or-skip rule as the data-parallel core: a step counts on a rank when its optimizer
update was applied, and a step whose collectives failed never reaches it (gloo raises out of
forward or backward). A failure (a dead rank, a partition, a collective that fails) is caught by
`with step:`, and then every live rank keeps its process:

    drop the group -> join the next generation -> agree on the newest step that every shard can
    be restored to (control/shard_plan.py) -> rebuild the mesh, modules and optimizer with `build`
    -> fill them from the rank's own live state, its own in-memory copy, a live replica, the
    buddy copy of a peer, or disk -> go on.

A failure is recognised by type (`CollectiveFailed`, torch's `DistError`), or as a RuntimeError
raised while the cluster moved to a new generation (gloo reports a lost peer as a plain
RuntimeError from inside FSDP's and DTensor's collectives); any other exception is the user's error
and ends the process. The random streams are re-seeded at every step from (job seed, rank, step),
as in the data-parallel core, so a redone step draws what the first try drew.

SIGTERM, SIGINT or SIGUSR1 stop every rank at the same step (the vote is one small all-reduce per
step); each saves a dying-gasp checkpoint when `checkpoints` is set, and the job exits 75.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable, Iterator

import torch
from torch import nn

from ..control.outcomes import SourceKind
from ..errors import ConfigError, JobStopped
from ..exitcodes import EXIT_FAULT_STOP
from ..meshspec import MeshSpec
from ..worker import runtime as rt_mod
from ..worker.transfer import all_max
from .engine.faults import env_callbacks
from .engine.preempt import GracefulStop
from .engine.step import is_collective_failure
from .parallel.buddy import Copies, HostCopy, flat_part, propose_every
from .shardrecover import Recovery
from .state.shardckpt import ShardedCheckpoints
from .state.train_state import reseed

log = logging.getLogger("trainguard.shardjob")

Build = Callable[[object], "tuple[nn.Module, torch.optim.Optimizer]"]
FIRST_EVERY = 2  # steps between the first snapshots, before their cost is known


class ShardStep:
    """One step; `with step:` around its body catches a failed collective (see the module docstring)."""

    __slots__ = ("job", "number", "failure")

    def __init__(self, job: "ShardedJob", number: int):
        self.job, self.number, self.failure = job, number, None

    def __enter__(self) -> "ShardStep":
        return self

    def __exit__(self, tp, exc, tb) -> bool:
        if exc is None or not self.job.is_fault(exc):
            return False
        self.failure = exc
        return True


class ShardedJob:
    def __init__(self, build: Build, mesh: MeshSpec, *, max_steps: int, checkpoints: ShardedCheckpoints | None = None,
                 snapshot_every: int | None = None, device: str | None = None, agree_timeout: float = 600.0,
                 runtime=None, callbacks=()):
        self.rt = runtime or rt_mod.current()
        mesh.check_world(self.rt.world_size)
        if max_steps < 0:
            raise ConfigError(f"max_steps must be >= 0, got {max_steps}")
        if snapshot_every is not None and snapshot_every < 1:
            raise ConfigError(f"snapshot_every must be >= 1 (or None: as often as costs at most 3% of the time), "
                              f"got {snapshot_every}")
        self.build_fn, self.spec, self.max_steps, self.ckpt = build, mesh, max_steps, checkpoints
        self.device = device or ("cuda" if self.rt.cfg.backend == "nccl" or (
            self.rt.cfg.backend == "auto" and torch.cuda.is_available()) else "cpu")
        self.agree_timeout = agree_timeout
        self.strategy = self.rt.cfg.recover_strategy
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.mesh = None
        self.step = 0  # committed steps
        self.seed: int | None = None
        self.source = ""  # where the last restore took this rank's state from, in words
        self.source_kind: SourceKind | None = None  # and its kind (a str enum: == "disk" holds)
        self.started = False
        self.recoveries = 0
        self.copies, self.host = Copies(), HostCopy()
        self.recovery = Recovery(self)
        self.stop = GracefulStop()
        self.callbacks = [*env_callbacks(), *callbacks]  # TG_FAULT*: chaos-test the job without changing it
        self.injectors = [cb for cb in self.callbacks if hasattr(cb, "on_phase")]
        self._fixed_every = snapshot_every
        self._every = snapshot_every or FIRST_EVERY
        self._next_snap = 0
        self._snap_wait = 0.0
        self._step_s = 0.0
        self.applied = False
        self.pending_report: float | None = None

    # --- the loop --------------------------------------------------------------------------

    def start(self) -> None:
        """Join the job's state (fresh, from disk, or from peers); `steps()` does it if not done."""
        if not self.started:
            self.started = True
            self.recovery.run(form=False, reason="")

    def steps(self) -> Iterator[ShardStep]:
        self.start()
        while True:
            while self.step < self.max_steps:
                step = ShardStep(self, self.step + 1)
                self.applied = False
                self.rt.step = self.step
                self.phase_point("before_exchange")
                t0 = time.monotonic()
                yield step
                self._end(step.failure, time.monotonic() - t0)
            if self.recovery.finish():
                return

    @property
    def snapshot_interval(self) -> int:
        """Steps between in-memory copies now (fixed, or the 3% rule's last agreed figure)."""
        return self._every

    def is_fault(self, exc: BaseException) -> bool:
        """A failure to recover from: typed, or a RuntimeError while the cluster moved on (waited for up to
        the heartbeat timeout: the scheduler learns a death from a closed connection or the agent at once)."""
        if is_collective_failure(exc):
            return True
        if not isinstance(exc, RuntimeError):
            return False
        deadline = time.monotonic() + self.rt.cfg.heartbeat_timeout + 2 * self.rt.cfg.heartbeat_interval
        while not self.rt.membership_changed():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def phase_point(self, name: str) -> None:
        for cb in self.injectors:
            cb.on_phase(self, name)

    def _end(self, failure: BaseException | None, took: float) -> None:
        committed = failure is None or self.applied
        if committed:
            self.step += 1
            self.recovery.note_commit()
            reseed(self.seed, self.rt.rank, self.step)
            for cb in self.callbacks:
                if hasattr(cb, "on_step_end"):
                    cb.on_step_end(self)
        if failure is None:
            try:
                signum = all_max(self.stop.request.signum, self.rt.group)
                self._step_s = took if not self._step_s else 0.9 * self._step_s + 0.1 * took
                if self.step >= self._next_snap:
                    self.snapshot_round()
                if self.ckpt is not None and self.ckpt.every and self.step % self.ckpt.every == 0:
                    self.ckpt.save(self.step, self.model, self.optimizer, self.seed)
            except Exception as exc:  # noqa: BLE001 - classified right here, re-raised if not a fault
                if not self.is_fault(exc):
                    raise
                failure = exc
            else:
                if signum:
                    self._stop_gracefully(signum)
                self._report_first_step()
                if self.rt.membership_changed():
                    self.recovery.run(form=True, reason="")
                return
        at = f"after step {self.step}" if committed else f"step {self.step + 1}"
        reason = f"{at}: {type(failure).__name__}: {str(failure)[:300]}"
        if not self.strategy.rolls_back:
            self.stop_on_fault(reason)
        self.recovery.run(form=True, reason=reason)

    def _report_first_step(self) -> None:
        if self.pending_report is not None:
            took, self.pending_report = time.monotonic() - self.pending_report, None
            self.rt.events.emit("step_finished", generation=self.rt.generation, step=self.step, rank=self.rt.rank,
                                recovery_s=round(took, 4))

    # --- in-memory copies -------------------------------------------------------------------

    def restart_cadence(self) -> None:
        """After a restore: every rank starts the cadence afresh (a replacement knows no history, and ranks
        that disagree on the snapshot steps would call different collectives)."""
        self._every = self._fixed_every or FIRST_EVERY
        self._snap_wait = 0.0

    def snapshot_round(self, *, agreed: bool = False) -> None:
        """At a snapshot step: agree on the cadence (skip if some rank's last round is still in flight), take
        this rank's copy, and hand it to the exchange thread. Every rank calls it at the same steps."""
        exchange = self.recovery.exchange
        t0 = time.monotonic()
        if not agreed:
            busy = exchange is None or exchange.busy
            mine = self._fixed_every or propose_every(self._snap_wait, exchange.work_s if exchange else 0.0,
                                                      self._step_s)
            verdict = all_max(MAX_PROPOSAL if busy else mine, self.rt.group)
            if verdict >= MAX_PROPOSAL:  # some rank is still exchanging the last copy: try at the next step
                self._next_snap = self.step + 1
                return
            self._every = verdict
        tensors, meta = flat_part(self.recovery.live_part(), {"seed": self.seed, "step": self.step})
        tensors, ready = self.host.take(tensors)
        exchange.submit(self.step, tensors, meta, ready)
        self._next_snap = self.step + self._every
        self._snap_wait = time.monotonic() - t0

    # --- stopping ---------------------------------------------------------------------------

    def _stop_gracefully(self, signum: int) -> None:
        self.stop.observe(signum)
        save = (lambda: self.ckpt.save(self.step, self.model, self.optimizer, self.seed)) if self.ckpt else (lambda: None)
        self.stop.exit(self.step, save)

    def stop_on_fault(self, reason: str) -> None:
        rt = self.rt
        self.recovery.close_exchange()
        rt.drop_group()
        rt.events.emit("stopped_on_fault", rank=rt.rank, step=self.step, strategy=str(self.strategy),
                       reason=reason[-500:], saved=[])
        print(f"trainguard: rank {rt.rank}: stopping (recover strategy {self.strategy}): {reason}",
              file=sys.stderr, flush=True)
        rt.finish(ok=False, detail=f"stopped after a fault ({self.strategy}): {reason}")
        raise JobStopped(EXIT_FAULT_STOP, reason, self.step)


MAX_PROPOSAL = 1 << 30  # a proposal that says "my last round is still in flight"
