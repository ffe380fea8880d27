"""The buffers a forward moves (BatchNorm's running statistics, counters) are part of the step.

Two things make them exact across a failure:

- **Shared.** Each rank's forward moves its buffers with its own batch, so after a step the ranks
  hold different statistics; DDP makes them equal again by broadcasting rank 0's before the next
  forward. If rank 0 died in between, its statistics died with it, and its replacement would take
  another rank's: a silent difference. `BufferShare` instead hands every rank rank 0's buffers *as
  part of the step's gradient exchange*: rank 0 writes its buffers into one flat tensor per dtype
  and the others write zeros, so the all-reduce's sum is rank 0's values exactly (x + 0 is exact),
  in the last gradient bucket's tail (train/parallel/riders.py: a buffer of another dtype goes
  byte by byte). A committed step therefore leaves every rank with the same buffers, they travel
  with the rest of the shared state, and no forward needs a broadcast: no collective of their own
  (one per dtype beside the bucket where they cannot ride: a bf16 bucket, another device).
- **Rolled back.** A step that is skipped (its exchange failed) must leave the buffers as they were
  before its forward. `BufferGuard` keeps a copy of their committed values, refreshed at every
  commit, and puts them back on a skip.

Only numeric buffers are shared (bool masks do not add); integer counters add exactly too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

NOT_SUMMABLE = (torch.bool,)


def module_buffers(module: nn.Module) -> list[torch.Tensor]:
    """Each buffer once (a buffer shared by two submodules is one tensor)."""
    seen: dict[int, torch.Tensor] = {}
    for b in module.buffers():
        seen.setdefault(id(b), b)
    return list(seen.values())


def moving_frozen(module: nn.Module) -> list[torch.Tensor]:
    """Parameters a forward may move outside the optimizer's update, which a step cut short must put back as it does
    the buffers: the frozen (requires_grad=False) floating ones, when they hold no more than the trainable ones do (a
    momentum encoder updated in the forward, MoCo's `encoder_k`, a mean teacher inside the model: a blind MoCo port
    exited 0 with other weights, the momentum applied twice at each rewind). A frozen backbone bigger than what
    trains is left out: its copy at every commit would cost more than the update (docs/porting.md)."""
    seen: dict[int, torch.Tensor] = {}
    for p in module.parameters():
        seen.setdefault(id(p), p)
    trainable = sum(p.numel() for p in seen.values() if p.requires_grad)
    frozen = [p for p in seen.values() if not p.requires_grad and p.is_floating_point()]
    return frozen if sum(p.numel() for p in frozen) <= trainable else []


class BufferShare:
    """Rank 0's buffers to every rank, riding in the step's exchange (see the module docstring): in the last gradient
    bucket's tail (train/parallel/riders.py) where it can, else as one all-reduce per dtype beside it."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers = [b for b in buffers if b.dtype not in NOT_SUMMABLE and not b.is_complex()]
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for b in self.buffers:
            groups.setdefault((b.dtype, b.device), []).append(b)
        self.groups = [(bs, torch.zeros(sum(b.numel() for b in bs), dtype=dt, device=dev))
                       for (dt, dev), bs in groups.items()]
        self.riding = False
        self._own: list[torch.Tensor] = []  # riding: the buffers of the bucket's dtype, as values
        self._bytes: list[torch.Tensor] = []  # riding: the others, byte by byte
        self._own_size = 0

    def __bool__(self) -> bool:
        return bool(self.buffers)

    # --- riding in the last bucket (train/parallel/riders.py) -------------------------------------------------

    def slots(self, dtype: torch.dtype, device: torch.device, world: int) -> int | None:
        if any(b.device != device for b in self.buffers):
            return None
        self._own = [b for b in self.buffers if b.dtype == dtype]
        self._bytes = [b for b in self.buffers if b.dtype != dtype]
        self._own_size = sum(b.numel() for b in self._own)
        return self._own_size + sum(b.numel() * b.element_size() for b in self._bytes)

    @torch.no_grad()
    def fill(self, view: torch.Tensor, rank: int) -> None:
        if rank != 0:
            return  # the tail is zeros
        n = self._own_size
        if self._own:
            torch.cat([b.reshape(-1) for b in self._own], out=view[:n])
        if self._bytes:
            view[n:].copy_(torch.cat([b.reshape(-1).view(torch.uint8) for b in self._bytes]))

    @torch.no_grad()
    def take(self, view: torch.Tensor) -> None:
        """Every rank takes rank 0's values, through `.data`, which leaves the buffers' version counters as they were: a
        graph that saved them before this exchange (a second loss backwarded from the same forward, `retain_graph`)
        would otherwise fail its backward, as it does not under torch's DDP, which writes them at the forward."""
        at = 0
        for b in self._own:
            b.data.copy_(view[at:at + b.numel()].view(b.shape))  # .data: see take()'s docstring
            at += b.numel()
        if self._bytes:
            raw = view[at:].round().to(torch.uint8)
            at = 0
            for b in self._bytes:
                n = b.numel() * b.element_size()
                b.data.copy_(raw[at:at + n].clone().view(b.dtype).view(b.shape))  # clone: aligned
                at += n

    # --- beside it ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def launch(self, rank: int, group: dist.ProcessGroup) -> list:
        works = []
        for bs, flat in self.groups:
            if rank == 0:
                torch.cat([b.reshape(-1) for b in bs], out=flat)
            else:
                flat.zero_()
            works.append(dist.all_reduce(flat, group=group, async_op=True))
        return works

    @torch.no_grad()
    def finish(self) -> None:
        """After the exchange completed: every rank takes rank 0's values."""
        for bs, flat in self.groups:
            offset = 0
            for b in bs:
                n = b.numel()
                b.data.copy_(flat[offset:offset + n].view(b.shape))  # .data: as in take()
                offset += n


class BufferGuard:
    """The committed values of a module's buffers; `rollback()` after a skipped step. Every buffer is copied
    at every commit: BatchNorm's kernel updates its running statistics in place without moving their
    version counters, so what a forward changed cannot be told without comparing."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers = buffers
        self.copies: list[torch.Tensor] = [b.detach().clone() for b in buffers]

    @torch.no_grad()
    def commit(self) -> None:
        """The step counted: its buffers are the committed ones."""
        if self.buffers:
            torch._foreach_copy_(self.copies, self.buffers)

    refresh = commit  # after a restore loaded new values

    @torch.no_grad()
    def rollback(self) -> None:
        """Put back what a skipped step's forward changed."""
        if self.buffers:
            torch._foreach_copy_(self.buffers, self.copies)


def guard_for(model, sharded: bool) -> BufferGuard | None:
    """The committed copy of `model`'s buffers that a step cut short or skipped is put back to: a data-parallel
    wrapper's own (`buffer_guard`); a sharded model's (FSDP2 leaves BatchNorm's statistics plain tensors, each rank's
    own: a forward of a step that never commits moves them, and a rewind would keep that move); None otherwise."""
    own = getattr(model, "buffer_guard", None)
    if isinstance(own, BufferGuard):
        return own
    if sharded and isinstance(model, nn.Module):
        buffers = module_buffers(model)
        return BufferGuard(buffers) if buffers else None
    return None
