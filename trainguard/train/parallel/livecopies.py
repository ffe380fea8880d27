"""The sharded part of the one engine: which shard each rank holds, the in-memory copies, and the transfers
of a restore (a collaborator of the Session when its model is sharded: train/parallel/sharding.py).

A copy is a committed state in the blob a peer receives ({"shared": this rank's part, "own": position and
seed}: Session.pack_live), so a rank's live state, its own copy and its buddy's copy of it are restored by
one `Session.adopt_blob`. The copies are this process's, not the script's: they outlive a rewind, in which
the script builds its modules again and the copies of the steps before are what a peer may still need.

At a snapshot step every rank copies its part to host memory (on CUDA into pinned buffers off the
compute stream: buddy.HostCopy), and the exchange thread packs it, keeps it, and swaps it with its
buddy's over a side group (train/parallel/buddy.py). The ranks snapshot at the same steps: the cadence rides in
the commit point's stop vote (one small all-reduce), as often as keeps the copies within 3% of the
steps' time, and a round is skipped while some rank's last one is still in flight. What counts is the
step's own wait for the host copy, and on CPU the thread's work too (it takes cores from the training);
on a GPU the thread works on host cores the training leaves idle, so there a copy can follow every step. A committed step is copied when the next one
begins, after the script's code that follows `optimizer.step()` (its `scheduler.step()`).

A restore's transfers follow one global order (the decision's (sender, receiver) pairs, sorted), which
every rank walks doing its part, so blocking sends and receives cannot wait on each other in a cycle.
"""

from __future__ import annotations

import logging
import time

import torch.distributed as dist

from ...control.outcomes import CopyKind, RestoreDecision, SourceKind
from ...errors import RecoveryError
from ...meshspec import ShardMap
from ...worker.transfer import recv_bytes, send_bytes
from .buddy import Copies, Exchange, HostCopy, propose_every
from .sharding import shard_map

log = logging.getLogger("trainguard.livecopies")

FIRST_EVERY = 1  # steps between snapshots before their cost is known
BUSY = 1 << 30  # a proposal that says "my last round is still in flight"

_copies = Copies()  # this process's copies: they outlive the script's runs (rewinds)


class LiveCopies:
    def __init__(self, session):
        self.session = session
        self.shards: ShardMap | None = None  # this generation's
        self.host = HostCopy()
        self.exchange: Exchange | None = None
        self.every = FIRST_EVERY
        self.next_snap = 0
        self.snap_wait = 0.0
        self.step_s = 0.0
        self._step_began: float | None = None
        self.due = False  # the committed step is to be copied when the next one begins

    @property
    def copies(self) -> Copies:
        return _copies

    def shard(self) -> int:
        return self.shards.shard_of(self.session.rt.rank)

    # --- a generation -----------------------------------------------------------------------------

    def attach(self) -> None:
        """This generation's shard map and exchange (collective: every rank, before the restore report)."""
        rt = self.session.rt
        self.close()
        self.shards = shard_map(self.session.state.model, rt.group, rt.rank, rt.world_size)
        side = dist.new_group(backend="gloo")  # the copies go host to host, beside the training collectives
        rank, shards = rt.rank, self.shards
        buddy, ward = shards.buddy(rank), shards.ward(rank)
        self.exchange = Exchange(_copies, side, shards.shard_of(rank), buddy, ward,
                                 None if ward is None else shards.shard_of(ward))

    def close(self, timeout: float = 5.0) -> None:
        """Stop the exchange thread, waiting up to `timeout` s. Called briefly before the generation's groups
        are cut and dropped, and again after (a round blocked on a dead or stopped peer ends when they are cut)."""
        if self.exchange is not None and self.exchange.close(timeout):
            self.exchange = None

    # --- the commit point ------------------------------------------------------------------------

    def begin_step(self) -> None:
        """A step begins: the copy voted at the last commit is taken now, once the script's code after
        `optimizer.step()` (its `scheduler.step()`) has run: that code belongs to the committed step."""
        if self.due:
            self.due = False
            self.snapshot()
        self._step_began = time.monotonic()

    def proposal(self) -> int:
        """This rank's vote on the steps between snapshots (BUSY: its last round is still in flight)."""
        if self._step_began is not None:
            took = time.monotonic() - self._step_began
            self.step_s = took if not self.step_s else 0.9 * self.step_s + 0.1 * took
            self._step_began = None
        ex = self.exchange
        if ex is None or ex.busy:
            return BUSY
        work = ex.work_s
        if work is None:  # no round of this generation measured yet (its first pays for the new group): copy again
            return FIRST_EVERY
        # on a GPU the thread's work overlaps the steps on idle host cores; on CPU it takes cores from the training
        return propose_every(self.snap_wait, 0.0 if self.host.on_device else work, self.step_s)

    def after_commit(self, voted: int) -> None:
        """Every rank, with the vote every rank got: take a copy of this committed step if it is due."""
        step = self.session.step
        if step < self.next_snap:
            return
        if voted >= BUSY:  # some rank is still exchanging the last copy: try at the next step
            self.next_snap = step + 1
            return
        self.every = voted
        self.next_snap = step + self.every
        self.due = True

    def snapshot(self) -> None:
        t0 = time.monotonic()
        tensors, meta = self.session.flat_live()
        tensors, ready = self.host.take(tensors)
        self.exchange.submit(self.session.step, tensors, meta, ready)
        self.snap_wait = time.monotonic() - t0

    def before_update(self) -> None:
        self.host.fence()  # a CUDA copy of the last snapshot still reading the tensors finishes first

    # --- a restore -------------------------------------------------------------------------------

    def transfer(self, decision: RestoreDecision) -> bytes | None:
        """Do this rank's part of the decision's transfers; the blob it received, if any."""
        session = self.session
        return walk_transfers(decision, session.rt.rank, session.rt.group, session.pack_live,
                              lambda r: _copies.get(self.shards.shard_of(r), decision.step))

    def own_copy(self, step: int) -> bytes:
        data = _copies.get(self.shard(), step)
        if data is None:
            raise RecoveryError(f"rank {self.session.rt.rank} was to restore its own copy of step {step}, which it "
                                "no longer holds")
        return data

    def restored(self) -> None:
        """After a restore: every rank starts the cadence afresh and copies the step everyone now holds (a
        replacement knows no history, and ranks that disagree on the snapshot steps would call different
        collectives)."""
        self.every, self.snap_wait, self.due = FIRST_EVERY, 0.0, False
        self.next_snap = self.session.step + self.every
        self.snapshot()


def walk_transfers(decision: RestoreDecision, rank: int, group, live_blob, copy_for) -> bytes | None:
    """This rank's part of a sharded restore's transfers, in the one global order (the decision's (sender,
    receiver) pairs, sorted); the blob it received, if any. `live_blob()` packs this rank's live state (at
    most once); `copy_for(r)` is the in-memory copy this rank holds for rank r (None: it no longer does)."""
    pairs = sorted((src.peer, r) for r, src in enumerate(decision.sources) if src.kind is SourceKind.PEER)
    got, live = None, None
    for q, r in pairs:
        if q == rank:
            if decision.source(r).origin is CopyKind.LIVE:
                live = live if live is not None else live_blob()
                data = live
            else:
                data = copy_for(r)
                if data is None:
                    raise RecoveryError(f"rank {rank} was to send rank {r} its in-memory copy of step "
                                        f"{decision.step} but no longer holds it")
            send_bytes(data, r, group)
        elif r == rank:
            got = recv_bytes(q, group)
    return got
