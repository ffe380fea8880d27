"""Data parallelism that survives regrouping: `DataParallel(net)` (alias `DDP`) stands where
`DistributedDataParallel(net)` stood.

It wraps the same parameters, so the optimizer is untouched, and its gradient exchange
(train/parallel/gradsync.py) is a bucketed all-reduce over a layout fixed once from the parameters:
overlapped with backward as DDP's, deterministic for a given world size and rank order, and
never raising inside backward (a failed exchange is recorded; the optimizer step is skipped).
Each generation attaches it to the new process group (`rebuild`); nothing is broadcast then,
because recovery hands every rank the same state. A fresh job starts from rank 0's parameters
and buffers, as DDP's constructor does, and in it: in the job's first generation every rank builds the wrapper
at once, so the constructor broadcasts them (a copy the script makes after `DDP(...)`, timm's EMA, is rank 0's, as
under torch's DDP). A fresh start takes them again at its first step (`broadcast_from`: after a fault before the
first commit, with no collective in the script's setup, which a replacement runs beside ranks in a step; in the
first run too, one broadcast more, so that `trainguard verify`'s `at:broadcast:N` counts as before).
Buffers (e.g. BatchNorm statistics): with `broadcast_buffers=True` (DDP's default) every committed step leaves
every rank with rank 0's, as DDP's broadcast before each forward would, but they ride in the step's exchange
instead (train/state/buffers.py), so a forward makes no collective and a skipped step puts them back.
With `broadcast_buffers=False` each rank keeps its own, and a replacement takes a peer's.

Virtual shards (`--virtual-shards V`, train/parallel/exactsum.py): each training forward is one shard's, in the
order of the rank's range, and draws its random numbers from the shard's key (`on_shard`). Every shard's
forward starts from the step's buffers, and the step ends with the buffers as shard 0's forward left them (rank 0
holds shard 0 at every world size; they ride to every rank as above): BatchNorm's running statistics after a
step are a function of shard 0's batch, whatever the world.
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ...errors import ConfigError
from ...worker import runtime
from ...worker.transfer import broadcast_module
from ..state.buffers import BufferGuard, BufferShare, module_buffers, moving_frozen
from .gradsync import GradSync

log = logging.getLogger("trainguard.parallel")

# DistributedDataParallel arguments accepted for a drop-in change and not needed here: devices follow
# the module, unused parameters add zero, and the bucket layout is fixed anyway
_IGNORED = frozenset({"device_ids", "output_device", "dim", "find_unused_parameters", "check_reduction",
                      "gradient_as_bucket_view", "static_graph"})


class DataParallel(nn.Module):
    """A data-parallel wrapper whose gradient exchange can be re-attached to each new process group; its
    `state_dict()` is torch DistributedDataParallel's (keys prefixed "module.")."""

    instances: "weakref.WeakSet[DataParallel]" = weakref.WeakSet()  # the guard finds the optimizer's model here

    def __init__(self, module: nn.Module, *, broadcast_buffers: bool = True, bucket_cap_mb: float = 25.0,
                 process_group=None, **ddp_kwargs):
        super().__init__()
        unknown = set(ddp_kwargs) - _IGNORED
        if unknown:
            raise ConfigError(f"DataParallel got unknown arguments {sorted(unknown)}; it takes the module, "
                              f"broadcast_buffers, bucket_cap_mb and ignores {sorted(_IGNORED)}")
        if process_group is not None:
            raise ConfigError("DataParallel(process_group=...) is not supported: trainguard builds a new group for "
                              "every generation and attaches the wrapper to it; leave process_group out")
        sparse = [name for name, m in module.named_modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
        if sparse:
            raise ConfigError(f"{sparse[0] or 'the module'} makes sparse gradients (sparse=True), which trainguard.DDP's "
                              "exchange does not carry (a fixed layout of dense buckets): build it with sparse=False "
                              "(its gradient is then a dense tensor, exchanged and recovered as any other)")
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        object.__setattr__(self, "sync", GradSync(module, bucket_cap_mb=bucket_cap_mb))
        buffers = module_buffers(module)
        if broadcast_buffers:
            self.sync.share = BufferShare(buffers)
        object.__setattr__(self, "buffer_guard", BufferGuard(buffers + moving_frozen(module)))
        object.__setattr__(self, "_own_buffers", buffers)
        object.__setattr__(self, "_buffers_at_step", [])  # under virtual shards: the buffers as the step began
        object.__setattr__(self, "_buffers_first", None)  # and as the rank's first shard's forward left them
        object.__setattr__(self, "group", None)
        self.on_forward: Callable[[], None] | None = None  # the guard starts the job on first use (train/engine/guard.py)
        self.after_forward: Callable[[tuple, dict, object], None] | None = None  # (args, kwargs, output): keys the
        # random streams after a training forward, and the replay audit fingerprints it
        self.on_shard: Callable[[int], None] | None = None  # a virtual shard's forward begins: key its draws
        rt = runtime.active()
        if rt is not None and rt.generation == 1 and rt.group is not None:  # the job's first run: every rank is here
            self.broadcast_from(0, rt.group)
        DataParallel.instances.add(self)

    @property
    def training(self) -> bool:
        """The wrapped module's mode: a framework may set it alone (Lightning puts back the module's mode after a
        validation, not its wrapper's), and train()/eval() on the wrapper set the module's too."""
        module = self.__dict__.get("_modules", {}).get("module")
        return module.training if module is not None else True

    @training.setter
    def training(self, mode: bool) -> None:
        pass  # nn.Module.train() sets the children's, the wrapped module's

    def rebuild(self, group: dist.ProcessGroup, shards: int = 0) -> None:
        object.__setattr__(self, "group", group)
        self.sync.set_shards(shards)
        self.sync.before_sum = self._shard_buffers_done
        self.sync.attach(group)

    def current_shard(self) -> int | None:
        """The virtual shard a training forward now would be (None without virtual shards, or outside training)."""
        ex = self.sync.exact
        if ex is None or not (torch.is_grad_enabled() and self.training) or ex.done >= len(ex.here):
            return None
        return ex.here[ex.done]

    def _shard_buffers(self) -> None:
        """Before a shard's training forward: the first one keeps the step's buffers; a later one keeps what the
        first left (once) and starts again from the step's (module docstring)."""
        if not self._own_buffers:
            return
        if self.sync.exact.done == 0:
            self._buffers_at_step = [b.clone() for b in self._own_buffers]
            self._buffers_first = None
            return
        if self._buffers_first is None:
            self._buffers_first = [b.clone() for b in self._own_buffers]
        for b, saved in zip(self._own_buffers, self._buffers_at_step):
            b.copy_(saved)

    def _shard_buffers_done(self) -> None:
        """The rank's last shard's backward ended: its buffers are as its first shard's forward left them."""
        if self._buffers_first is not None:
            for b, saved in zip(self._own_buffers, self._buffers_first):
                b.copy_(saved)
        self._buffers_first = None

    def drop(self) -> None:
        object.__setattr__(self, "group", None)
        self.sync.detach()

    def close(self) -> None:
        """This run of the script is over (a rewind): no more exchanges. The gradient hooks go, because torch
        holds them in C++, where the collector cannot see that they and the module keep each other alive:
        left, they would keep this run's model, optimizer and everything its frames held after it."""
        self.drop()
        self.sync.close()

    def ride(self, rider) -> None:
        """`rider` rides in every gradient exchange from the next backward on (train/parallel/riders.py)."""
        self.sync.ride(rider)

    def no_sync(self):
        """As DDP's: gradients accumulate locally until the next backward outside the block."""
        return self.sync.no_sync()

    @property
    def require_backward_grad_sync(self) -> bool:
        """As DDP's attribute (nanoGPT sets it per micro-step): False makes the backwards that follow accumulate
        locally, True makes the next one exchange the sum. `no_sync()` sets it for its block."""
        return self.sync.enabled

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.sync.enabled = bool(value)

    def register_comm_hook(self, state, hook) -> None:
        """Refused, by name: the exchange's bits depend on its fixed layout and full precision (gradsync.py), which a
        hook (fp16/bf16 compression, PowerSGD) would change between a run and its recovery."""
        raise ConfigError(f"DDP.register_comm_hook({getattr(hook, '__name__', hook)!r}) is not supported by "
                          "trainguard.DDP: its gradient exchange is a fixed-layout all-reduce in the gradients' own "
                          "dtype, which is what keeps a recovered run bit-identical. Remove the call (train in "
                          "bf16 autocast to halve the compute instead)")

    def join(self, *args, **kwargs):
        """Refused: uneven inputs would leave ranks at different steps, which a recovery cannot agree on."""
        raise ConfigError("DDP.join() (uneven inputs) is not supported by trainguard.DDP: every rank must take the "
                          "same number of steps. Use trainguard.DistributedSampler (it pads every rank's share to "
                          "the same length) or drop_last=True")

    def broadcast_from(self, src: int, group: dist.ProcessGroup) -> None:
        """Every rank takes `src`'s parameters and buffers (a fresh job's start)."""
        broadcast_module(self.module, src, group)  # trainguard's own collectives (transfer.py)

    def forward(self, *args, **kwargs):
        if self.on_forward is not None:
            self.on_forward()
        if (shard := self.current_shard()) is not None:
            self._shard_buffers()
            if self.on_shard is not None:
                self.on_shard(shard)
        out = self.module(*args, **kwargs)
        if self.after_forward is not None:
            self.after_forward(args, kwargs, out)
        return out

    @property
    def unwrapped(self) -> nn.Module:
        """The wrapped net, whose state the job keeps (its `state_dict()` keys are "module."-prefixed, as torch's
        DistributedDataParallel's are, so that a script's own checkpoints load either way)."""
        return self.module


DDP = DataParallel
DistributedDataParallel = DataParallel
