"""The recovery of a sharded job (train/shardjob.py): regroup, agree, rebuild, restore.

The live part of a rank is held as references to the local tensors of its modules and optimizer
(taken once they exist; the optimizer updates them in place), so the state a rank keeps after a
failure costs no copy, and it outlives the modules it came from: after the rebuild it is copied
into the new ones. Transfers between ranks follow one global order (the decision's list of
(sender, receiver) pairs, sorted), which every rank walks doing its part, so blocking sends and
receives cannot wait on each other in a cycle.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..checkpoint.blob import pack, unpack
from ..control.outcomes import RestoreDecision, SourceKind
from ..control.reports import FinishReport, ShardedRestoreReport
from ..errors import ClusterFailed, CollectiveFailed, FencedError, RecoveryError
from ..worker.sever import open_sockets
from ..worker.transfer import broadcast_int
from .parallel.buddy import Exchange
from .parallel.livecopies import walk_transfers
from .state import shardstate
from .state.train_state import job_seed, reseed

if TYPE_CHECKING:
    from .shardjob import ShardedJob

log = logging.getLogger("trainguard.shardrecover")

class Recovery:
    def __init__(self, job: "ShardedJob"):
        self.job = job
        self.exchange: Exchange | None = None
        self._refs: dict | None = None  # the live part: references into the current modules and optimizer
        self._live = False  # the current modules hold the state of job.step

    # --- the live part ------------------------------------------------------------------------

    def note_commit(self) -> None:
        self._live = True
        if self._refs is not None and not self._refs["optim"]["state"] and self.job.optimizer.state:
            self._refs = self._capture()  # the optimizer made its state at its first step

    def live_part(self) -> dict:
        """The live part with the optimizer's current hyperparameters (a scheduler may have changed them)."""
        opt = self.job.optimizer
        return {**self._refs, "optim": {**self._refs["optim"], "groups": shardstate.groups(opt)}}

    def _capture(self) -> dict:
        return shardstate.capture(self.job.model, self.job.optimizer, copy=False)

    def close_exchange(self) -> None:
        if self.exchange is not None:
            self.exchange.close()
            self.exchange = None

    # --- a recovery -------------------------------------------------------------------------------

    def run(self, *, form: bool, reason: str) -> None:
        job, rt = self.job, self.job.rt
        t0 = time.monotonic()
        live = self.live_part() if self._live and self._refs is not None else None
        if form:
            job.recoveries += 1
            log.warning("rank %d: recovering (%s)", rt.rank, reason or "membership changed")
        job.model = job.optimizer = job.mesh = None  # the old modules are bound to the old group
        self._refs, self._live = None, False
        reported = False
        while True:
            try:
                if form:
                    self.close_exchange()
                    rt.drop_group()  # peers blocked in a collective with us fail now, not at its timeout
                    self.close_exchange()
                    rt.events.emit("left_generation", generation=rt.generation, rank=rt.rank)
                    if reason and not reported:
                        rt.report_failure(reason)
                        reported = True
                    rt.form()
                form = True
                decision = rt.client.agree(rt.generation, "restore", self._report(live), job.agree_timeout)
                if decision.error is not None:
                    raise RecoveryError(decision.error)
                self._apply(decision, live)
                break
            except ClusterFailed as exc:  # the job is over (failed, or the launcher gave up): leave cleanly
                job.stop_on_fault(str(exc))
            except FencedError as exc:
                log.warning("rank %d: %s; regrouping", rt.rank, exc)
            except CollectiveFailed as exc:
                log.warning("rank %d: failure during recovery (%s); regrouping", rt.rank, str(exc)[:200])
        took = time.monotonic() - t0
        if job.recoveries or rt.generation > 1:
            job.pending_report = t0
        if (job.recoveries or rt.generation > 1) and rt.rank == 0:  # a replacement rank 0 says it too
            print(f"trainguard: generation {rt.generation}: resumed at step {decision.step} "
                  f"(lost {decision.lost_steps} steps), regrouped and restored in {took:.3f} s", flush=True)

    def _report(self, live: dict | None) -> ShardedRestoreReport:
        job, rt = self.job, self.job.rt
        disk = []
        if job.ckpt is not None and (job.ckpt.resume or rt.generation > 1):
            disk = job.ckpt.complete_steps()
        return ShardedRestoreReport(step=job.step if live is not None else None, shard=job.spec.shard_of(rt.rank),
                                    memory=job.copies.held(), disk=disk, node=rt.node_id)

    def _build(self) -> None:
        """The user's modules for this generation's group, and the side group the copies travel on."""
        job, rt = self.job, self.job.rt
        from torch.distributed.device_mesh import init_device_mesh

        torch.manual_seed(job.seed or 0)  # replicas of a fresh start are built alike
        before = open_sockets()
        job.mesh = init_device_mesh(job.device, job.spec.shape, mesh_dim_names=job.spec.names)
        job.model, job.optimizer = job.build_fn(job.mesh)
        if rt.backend != "gloo":  # NCCL's own connections are not ours to cut (it is aborted instead)
            before = open_sockets()
        side = dist.new_group(backend="gloo")  # the copies go host to host, beside the training collectives
        rt.track_sockets(before)
        job.optimizer.register_step_pre_hook(self._before_update)
        job.optimizer.register_step_post_hook(self._after_update)
        spec, rank = job.spec, rt.rank
        buddy, ward = spec.buddy(rank), spec.ward(rank)
        self.exchange = Exchange(job.copies, side, spec.shard_of(rank), buddy, ward,
                                 None if ward is None else spec.shard_of(ward))

    def _before_update(self, *_):
        self.job.host.fence()  # a CUDA copy of the last snapshot still reading these tensors finishes first
        self.job.phase_point("after_exchange")

    def _after_update(self, *_):
        self.job.applied = True
        self.job.phase_point("in_commit")

    def _apply(self, decision: RestoreDecision, live: dict | None) -> None:
        job, rt = self.job, self.job.rt
        s = decision.step
        mine = decision.source(rt.rank)
        kind = mine.kind
        if kind is SourceKind.INIT:
            job.seed = broadcast_int(job_seed(), 0, rt.group)
        self._build()
        received = self._transfer(s, decision, live)
        part, seed = None, None
        if kind is SourceKind.SELF:
            part, seed = live, job.seed
        elif kind in (SourceKind.MEMORY, SourceKind.PEER):
            data = job.copies.get(job.spec.shard_of(rt.rank), s) if kind is SourceKind.MEMORY else received
            blob = unpack(data, f"the state of step {s}")
            part, seed = blob["part"], blob["seed"]
        elif kind is SourceKind.DISK:
            seed = job.ckpt.load(s, job.model, job.optimizer)
        if part is not None:
            shardstate.load(job.model, job.optimizer, part)
        if seed is not None:
            job.seed = int(seed)
        elif job.seed is None:
            job.seed = 0
        job.step = s
        self._refs, self._live = self._capture(), True
        reseed(job.seed, rt.rank, s)
        job.source_kind, job.source = kind, mine.words()
        rt.events.emit("restored", generation=rt.generation, rank=rt.rank, step=s, source=kind.value,
                       peer=mine.peer, copy=None if mine.origin is None else mine.origin.value)
        if kind not in (SourceKind.SELF, SourceKind.INIT) and (job.recoveries or rt.generation > 1):
            print(f"trainguard: rank {rt.rank}: restored shard {job.spec.shard_of(rt.rank)} at step {s} from "
                  f"{job.source}", flush=True)
        if rt.rank == 0:
            rt.events.emit("restore_step", generation=rt.generation, to_step=s, from_step=decision.from_step,
                           fresh=decision.fresh)
        job.restart_cadence()
        job.snapshot_round(agreed=True)  # every rank, at once: a copy of the step everyone now holds

    def _transfer(self, s: int, decision: RestoreDecision, live: dict | None) -> bytes | None:
        job = self.job
        return walk_transfers(decision, job.rt.rank, job.rt.group,
                              lambda: pack({"part": live, "seed": job.seed, "step": s}),
                              lambda r: job.copies.get(job.spec.shard_of(r), s))

    def finish(self) -> bool:
        """The last barrier: True when everyone reached the end; False after a late failure sent us back to
        recover (maybe to an earlier step, which the loop then trains again)."""
        job, rt = self.job, self.job.rt
        try:
            rt.client.agree(rt.generation, "finish", FinishReport(step=job.step), job.agree_timeout)
        except FencedError:
            self.run(form=True, reason="")
            return False
        self.close_exchange()
        return True
