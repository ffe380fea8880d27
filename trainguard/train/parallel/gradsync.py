"""The gradient exchange: a bucketed all-reduce over a layout fixed once from the parameters.

Why it is deterministic. A ring (or halving-doubling) all-reduce adds the ranks' values in an
order that depends on where an element sits in the buffer being reduced: gloo splits the buffer
into chunks by size and offset, and each chunk's sum starts at another rank. The same buffer
layout gives the same order, and so the same bits, in every separately built process group
(checked with 3 and 4 ranks on torch 2.13); move a tensor to another offset and the bits change.
DDP re-buckets after its first iteration by the order gradients became ready, so its layout is
not a function of the model alone. Here the layout is: parameters in reverse registration order
(the order backward usually produces them), split by dtype and device into buckets closed once
they reach `bucket_cap_mb` (the first one `first_bucket_mb`, as DDP does, so communication starts
early). It never changes for a given model and world size, so every incarnation of every rank,
and every rebuilt group, sums in the same order.

Overlap. A post-accumulate-grad hook copies each gradient into its bucket and makes `param.grad`
a view of its place there (DDP's gradient_as_bucket_view: no copy back, no second gradient
buffer; when the grad already is that view, as after zero_grad(set_to_none=False), autograd
accumulated into the bucket and nothing is copied). A bucket is launched (async all-reduce) as
soon as all its gradients are in and every earlier bucket is launched, so every rank issues the
same collectives in the same order. At the end of backward the remaining buckets are launched
(missing gradients count as zero), everything is waited for, and each bucket is divided by the
world size in place: the grads, its views, hold the mean.

Commit-or-skip. Nothing here raises inside backward: a failed collective is recorded
(`CollectiveFailed`, the original as its cause) and `result()` raises it where the optimizer is
about to step, so a failed exchange never leads to an update.

The heap. Replacing autograd's gradient by the view frees it in the middle of backward, where
DDP frees its gradients at the next zero_grad(). With glibc's malloc that freed a few MB at the top
of the heap, past its trim threshold (twice the largest block it has unmapped so far), so it gave
them back to the kernel and took them again at the next backward: 100-250 page faults a step, 5%
of a 1M-parameter step. DDP's process escapes this by accident (its constructor's coalesced
broadcast frees a block the size of the model). `keep_heap` does it on purpose: one block of
twice the gradients' size, allocated and freed, raises the thresholds as glibc itself would. A
block over glibc's 32 MB maximum would change nothing, so it is capped just below (5M parameters:
20 MB of gradients, 500-2000 page faults a step with a 32 MB block, 0 with the cap); other
allocators ignore the hint. `bench/overhead.py` prints page faults per step.

Control slots. The last bucket (if float32 or float64; otherwise one small extra buffer) carries
`world_size` more elements: rank r writes its control value (the stop vote: a signal number or 0)
into slot r and zeros elsewhere. The sum hands every rank every rank's value at no extra
collective; integers below 2**24 add exactly.

Riders. After the control slots, the same bucket carries the riders (train/parallel/riders.py): rank
0's buffers (BatchNorm statistics, train/state/buffers.py), so a committed step leaves every rank
with the same buffers and no forward broadcasts them, and any other small exchange a step needs
(`riders`: Lightning's logged values). The tail's length is fixed by the model, the world size and
the riders' capacities, so the gradients' summation order never depends on a step's contents.

Virtual shards (`set_shards(V)`): the float sum over ranks is bit-identical only at one world size. With V
shards each backward is one shard's (`exactsum.shard_range`); the earlier shards' gradients are kept, and in the
rank's last shard's backward each bucket leaves as it fills, summed over one fixed tree of the shards
(exactsum.py): the same bits at every W.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ...errors import CollectiveFailed
from ...worker.collectives import internal
from .exactsum import ShardSum, TreeSum
from .riders import Reached

MB = 1 << 20
GLIBC_MMAP_THRESHOLD_MAX = 32 * MB  # a freed block larger than this leaves glibc's thresholds where they are
HEAP_BLOCK_MAX = GLIBC_MMAP_THRESHOLD_MAX - 64 * 1024  # room for the chunk header and alignment
CONTROL_DTYPES = (torch.float32, torch.float64)


@dataclass(slots=True)
class Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    size: int  # elements of gradient (control slots come after, in the control bucket only)
    dtype: torch.dtype
    device: torch.device
    buffer: torch.Tensor | None = None
    views: list[torch.Tensor] = field(default_factory=list)  # each parameter's place in `buffer`, its shape
    grads: torch.Tensor | None = None  # buffer[:size]: the gradients without the control slots
    missing: int = 0  # gradients not yet in, this backward
    arrived: list[bool] = field(default_factory=list)
    local: torch.Tensor | None = None  # this rank's own gradients as launched (kept only for an exchange redone)


def plan_buckets(params: list[nn.Parameter], cap_bytes: int, first_cap_bytes: int) -> list[Bucket]:
    """The fixed layout (pure): reverse registration order, split by dtype/device and size. As DDP's
    assignment does, a bucket is closed once it reaches its cap (the first one's is small), so a large
    gradient closes its bucket and starts communicating while backward goes on with earlier layers."""
    buckets: list[Bucket] = []
    current: Bucket | None = None
    for p in reversed(params):
        if current is None or current.dtype != p.dtype or current.device != p.device:
            current = Bucket([], [], 0, p.dtype, p.device)
            buckets.append(current)
        current.params.append(p)
        current.offsets.append(current.size)
        current.size += p.numel()
        if current.size * p.element_size() >= (first_cap_bytes if len(buckets) == 1 else cap_bytes):
            current = None
    return buckets


def keep_heap(nbytes: int) -> None:
    """Let glibc keep up to 2 * nbytes freed at the top of the heap instead of trimming it (see the module
    docstring): a block this large is mmapped, and unmapping it raises the mmap threshold to its size and
    the trim threshold to twice that. Not a setting: later, larger blocks raise them further, as usual."""
    block = torch.empty(min(nbytes, HEAP_BLOCK_MAX), dtype=torch.uint8)
    del block


class GradSync:
    """Hooks on `module`'s parameters; `attach(group)` for each generation, `detach()` between."""

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0):
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = plan_buckets(params, int(bucket_cap_mb * MB), int(first_bucket_mb * MB))
        self._where = {id(p): (b, i) for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)}
        self.group: dist.ProcessGroup | None = None
        self.world, self.rank = 1, 0
        self.control: Callable[[], int] = lambda: 0  # this rank's control value, read as the last bucket leaves
        self.after_launch: Callable[[], None] | None = None  # called once per backward, after the first launch
        self.controls: list[int] = []  # every rank's control value from the last completed exchange
        self.error: CollectiveFailed | None = None
        self.share = None  # a BufferShare (train/state/buffers.py): rank 0's buffers ride with the last bucket
        self.reached = Reached(self.buckets)  # which parameters some rank's backward reached (riders.py)
        self.riders: list = [self.reached]  # the riders (riders.py), after the share
        self.enabled = True  # False inside no_sync()
        self.shards = 0  # virtual shards (set_shards): 0 for the float sum over the ranks
        self.exact: ShardSum | None = None  # this step's shards' gradients and their sum, under virtual shards
        self.before_sum: Callable[[], None] | None = None  # as the rank's last shard's last bucket leaves (ddp.py)
        # a failed exchange done again with this rank's own gradients, in the next generation (train/engine/instep.py):
        # `on_failure(error)` recovers and says whether to; the gradients are kept as launched (one copy) in the
        # backwards where `keeps_local()` said, at their start, that a failure would be recovered so
        self.on_failure: Callable[[CollectiveFailed], bool] | None = None
        self.keeps_local: Callable[[], bool] = lambda: False
        self._keeping = False
        self.deferred: BaseException | None = None  # what that recovery raised, raised by result() in the step
        self.after_exchange: Callable[[], None] | None = None  # at the end of every exchange, done or failed
        self._control: torch.Tensor | None = None  # the extra buffer, when the last bucket cannot carry slots
        self._rides: list[tuple] = []  # (rider, start, end) in the last bucket's tail, after the control slots
        self._works: list = []
        self._launched = 0
        self._in_pass = False
        self._synced = False  # an exchange completed since the last result()
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        cpu_bytes = sum(b.size * b.params[0].element_size() for b in self.buckets if b.device.type == "cpu")
        if cpu_bytes:
            keep_heap(2 * cpu_bytes)

    # --- generations ----------------------------------------------------------------------

    def attach(self, group: dist.ProcessGroup) -> None:
        self.group, self.world, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self._lay_out()
        self._reset()

    def set_shards(self, shards: int) -> None:
        """Sum over `shards` virtual shards, exactly, from the next generation's attach on (module docstring)."""
        self.shards = shards

    def _lay_out(self) -> None:
        """The buckets' buffers; the last one's tail: the control slots, then what rides (see the docstring)."""
        last = self.buckets[-1] if self.buckets else None
        carries = last is not None and last.dtype in CONTROL_DTYPES
        self._rides, at = [], self.world
        for rider in ([self.share] if self.share else []) + self.riders:
            n = rider.slots(last.dtype, last.device, self.world) if carries else None
            rider.riding = n is not None
            if n is not None:
                self._rides.append((rider, at, at + n))
                at += n
        for b in self.buckets:
            extra = at if b is last and carries else 0
            length = max(b.size + extra, TreeSum.padded_size(b.size, self.world) if self.shards else 0)  # exactsum.py
            if b.buffer is None or b.buffer.numel() != length:
                b.buffer = torch.zeros(length, dtype=b.dtype, device=b.device)
                b.views = [b.buffer[off:off + p.numel()].view(p.shape) for p, off in zip(b.params, b.offsets)]
                b.grads = b.buffer[:b.size]
        device = last.device if last is not None else torch.device("cpu")
        self._control = None if carries else torch.zeros(self.world, dtype=torch.float32, device=device)
        self.exact = ShardSum(self.shards, self.world, self.rank, [(b.size, b.buffer) for b in self.buckets],
                              at if carries else 0) if self.shards else None

    def _grads(self) -> list[torch.Tensor]:
        return [b.grads for b in self.buckets]

    def _rooms(self) -> list[torch.Tensor]:
        return [b.buffer for b in self.buckets]

    def ride(self, rider) -> None:
        """`rider` rides in every exchange from the next backward on (riders.py)."""
        self.riders.append(rider)
        if self.group is not None:
            self._lay_out()

    @property
    def hooked(self) -> bool:  # its gradient hooks are on (until close(): a rewound run's model)
        return bool(self._handles)

    def detach(self) -> None:
        self.group = None
        self._reset()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _reset(self) -> None:
        self._works, self._launched, self._in_pass, self._synced = [], 0, False, False
        self.error = None
        if self.exact is not None:
            self.exact.clear()

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients accumulate locally; the next backward outside exchanges the sum (as DDP's no_sync)."""
        before, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = before

    # --- one backward -----------------------------------------------------------------------

    def _on_grad(self, p: torch.Tensor) -> None:
        if self.group is None or (not self.enabled and self.exact is None):  # a shard's backward always counts
            return
        if not self._in_pass:
            self._begin()
        b, i = self._where[id(p)]
        bucket = self.buckets[b]
        if bucket.arrived[i]:
            return
        view = bucket.views[i]
        if p.grad.data_ptr() != view.data_ptr():  # else autograd accumulated into the bucket itself
            view.copy_(p.grad)
            p.grad = view
        bucket.arrived[i] = True
        bucket.missing -= 1
        if self.exact is None or self.exact.in_last:
            self._launch_ready()

    def _begin(self) -> None:
        self._in_pass, self._launched, self._works, self._synced = True, 0, [], False
        self._keeping = self.on_failure is not None and self.exact is None and self.keeps_local()
        for b in self.buckets:
            b.missing, b.arrived = len(b.params), [False] * len(b.params)
        torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _launch_ready(self) -> None:
        while self._launched < len(self.buckets) and self.buckets[self._launched].missing == 0:
            self._launch(self._launched)
            self._launched += 1

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        last = b == len(self.buckets) - 1
        if last:
            if self.exact is not None and self.before_sum is not None:
                self.before_sum()  # the buffers as shard 0's forward left them (ddp.py), before they ride
            self._fill_tail()
        if self.error is not None:
            return
        if self._keeping:
            if bucket.local is None or bucket.local.shape != bucket.grads.shape:
                bucket.local = torch.empty_like(bucket.grads)
            bucket.local.copy_(bucket.grads)
        try:
            with internal():
                if self.exact is not None:  # its nodes leave, the previous bucket's root is gathered (exactsum.py)
                    self._works += self.exact.launch(b, self._rooms(), self.group)
                else:
                    self._works.append(dist.all_reduce(bucket.buffer, group=self.group, async_op=True))
                if last and self._control is not None:
                    self._works.append(dist.all_reduce(self._control, group=self.group, async_op=True))
                if last and self.share and not self.share.riding:
                    self._works += self.share.launch(self.rank, self.group)
        except (RuntimeError, CollectiveFailed) as exc:  # CollectiveFailed: the generation already failed
            self._fail(exc)
        if b == 0 and self.after_launch is not None:
            self.after_launch()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = CollectiveFailed(f"the gradient exchange failed: {exc}")
            self.error.__cause__ = exc

    def _finish(self) -> None:
        """End of backward: launch what is left, wait, and hand the mean back to the gradients."""
        self._in_pass = False
        partial = self.buckets[self._launched:]  # some gradient did not arrive this pass: it adds zero
        for bucket in partial:
            for i, view in enumerate(bucket.views):
                if not bucket.arrived[i]:
                    view.zero_()
            bucket.missing = 0
        if self.exact is not None and not self.exact.in_last:  # an earlier shard's backward: kept (exactsum.py)
            self.exact.keep(self._grads())
            return
        self._launch_ready()
        if self.exact is not None:
            self._exact_end()
        self._wait()
        if self.error is not None and self._keeping and self._recovered(self.error):
            self._redo()
        if self.after_exchange is not None:
            self.after_exchange()
        if self.error is not None:
            return
        tail = self.buckets[-1].buffer[self.buckets[-1].size:] if self._control is None else self._control
        self.controls = [int(v) for v in tail[:self.world].tolist()]
        for rider, start, end in self._rides:
            rider.take(tail[start:end])
        if self.share and not self.share.riding:
            self.share.finish()
        if self.exact is None:
            for bucket in self.buckets:
                bucket.grads.div_(self.world)
        for b, bucket in enumerate(partial, len(self.buckets) - len(partial)):  # None: no rank reached it
            for i, (p, view) in enumerate(zip(bucket.params, bucket.views)):
                if p.grad is None and (self.exact is not None or self.reached.by_some(b, i)) or \
                        p.grad is not None and p.grad.data_ptr() != view.data_ptr():  # an old gradient: now 0
                    p.grad = view
        self._synced = True

    def _exact_end(self) -> None:
        """After the last shard's buckets left: the roots not gathered yet; once everything is in, the sums land."""
        try:
            with internal():
                self._works += [] if self.error else self.exact.gather_last(self._rooms(), self.group)
        except (RuntimeError, CollectiveFailed) as exc:
            self._fail(exc)
        finally:
            self.exact.clear()
        self._wait()
        if self.error is None:
            self.exact.land(self._rooms())

    def _fill_tail(self) -> torch.Tensor:
        """The control slots and the riders, this rank's values written, zeros elsewhere (each slot is one rank's)."""
        last = self.buckets[-1]
        tail = last.buffer[last.size:] if self._control is None else self._control
        tail.zero_()
        tail[self.rank] = float(self.control())
        for rider, start, end in self._rides:
            rider.fill(tail[start:end], self.rank)
        return tail

    def _wait(self) -> None:
        for work in self._works:
            try:
                work.wait()
            except (RuntimeError, CollectiveFailed) as exc:  # a TypedWork fails as CollectiveFailed
                self._fail(exc)
        self._works = []

    def _recovered(self, error: CollectiveFailed) -> bool:
        """Whether the job recovered with this rank still in its step (the hook attached the next generation's group).
        Run at the end of backward, in autograd's callback: what the recovery raises is raised by `result()`."""
        try:
            if self.on_failure(error):
                return True
        except BaseException as exc:  # noqa: BLE001  a Rewind, a job that ended: raised where the optimizer steps
            self.deferred = exc
        self.error = error  # a new group's attach cleared it: the step still must not be applied
        return False

    def _redo(self) -> None:
        """The exchange again, in the new group, from this rank's own gradients as they were first launched."""
        self._works, self._launched, self.error = [], 0, None
        for bucket in self.buckets:
            bucket.grads.copy_(bucket.local)
        self._launch_ready()
        self._wait()

    # --- the commit point -----------------------------------------------------------------------

    def result(self) -> None:
        """Raise CollectiveFailed if this step's exchange failed (the optimizer must not step), or what the recovery
        in the step raised."""
        deferred, self.deferred = self.deferred, None
        if deferred is not None:
            raise deferred
        if self.exact is not None and self.exact.done:
            raise self.exact.unfinished()
        if self.error is not None:
            raise self.error

    def controls_fresh(self) -> bool:
        """True once per completed exchange: `controls` are this step's."""
        fresh, self._synced = self._synced, False
        return fresh
