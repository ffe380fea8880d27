"""What rides in the step's gradient exchange: small exchanges folded into its last bucket instead of collectives of
their own.

On a CPU job every collective costs about as much to launch and wait for as a small bucket (gloo wakes its threads
and the ranks meet once more): measured with the Lightning example, two extra collectives a step were 0.3 of its
step time. So everything a step must exchange besides its gradients goes in the last bucket's tail, after the
gradients and the control slots (gradsync.py), when that bucket is float32 or float64:

- `BufferShare` (train/state/buffers.py): rank 0's buffers, the others' zeros;
- `RankRows`: every rank's vector of float64 numbers (Lightning's logged values, compat/lightning_ranks.py), each
  rank writing its row and zeros elsewhere.

Why the sum is exact. Each slot holds one rank's value and zeros from every other: x + 0 is x whatever the order. A
value that is not the bucket's own dtype travels as integers small enough for it to hold exactly (a float64's bits
in four 16-bit pieces, another buffer's bytes one by one), and integers below 2**24 add exactly.

Why the gradients keep their bits. gloo's summation order depends on the buffer's length, so the tail's length is a
function of the model, the world size and fixed capacities, never of a step's contents: the same in every run of the
script, a replacement's included. A part that does not fit goes its own way (its owner's fallback).

A rider implements `slots(dtype, device, world)` (its length in a bucket of that dtype on that device, or None if it
cannot ride there), `fill(view, rank)` (the zeroed tail's part of this rank, before the launch) and `take(view)`
(the summed part, after the exchange completed); gradsync sets `riding` on it at each attach.
"""

from __future__ import annotations

import torch

PIECES = 4  # a float64's bits travel as four 16-bit integers, which a float32 or float64 bucket holds exactly


def encode_float64(values: torch.Tensor) -> torch.Tensor:
    """Float64 values as their bits in signed 16-bit pieces, in memory order (pure): four per value, each in
    -32768..32767. One view, no arithmetic: the bits are the same on every rank of a job (one byte order)."""
    return values.to(torch.float64).contiguous().view(torch.int16)


def decode_float64(pieces: torch.Tensor) -> torch.Tensor:
    """The inverse of `encode_float64` (pure); `pieces` may be any dtype holding the integers exactly."""
    return pieces.round().to(torch.int16).contiguous().view(torch.float64)


class RankRows:
    """Every rank's vector of `capacity` float64 numbers, gathered by riding in the gradient exchange: `send()` before
    the backward, `rows` ([world, capacity] float64, or None) after it. Not riding (a bf16 model's last bucket, no
    exchange this step), `rows` stays None and the owner gathers some other way."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.riding = False
        self.rows: torch.Tensor | None = None
        self._pending: torch.Tensor | None = None
        self._world = 1

    def send(self, vector: torch.Tensor) -> None:
        """This rank's numbers (float64, `capacity` of them) for the next exchange."""
        self._pending = encode_float64(vector.reshape(-1))
        self.rows = None

    def slots(self, dtype: torch.dtype, device: torch.device, world: int) -> int | None:
        self._world = world
        return world * self.capacity * PIECES

    @torch.no_grad()
    def fill(self, view: torch.Tensor, rank: int) -> None:
        if self._pending is not None:
            view.view(self._world, -1)[rank].copy_(self._pending)

    @torch.no_grad()
    def take(self, view: torch.Tensor) -> None:
        if self._pending is not None:
            self.rows = decode_float64(view.view(self._world, -1))
            self._pending = None


class Flag:
    """One flag every rank raises or not, gathered by riding in the gradient exchange: `on_any()` is called after an
    exchange in which some rank's `raised()` was true (each rank adds 1 or 0 to one slot: counts below 2**24 are
    exact). Used to spread what one rank learnt to every rank at no collective of its own (train/engine/instep.py)."""

    def __init__(self, raised, on_any) -> None:
        self.raised, self.on_any = raised, on_any
        self.riding = False

    def slots(self, dtype: torch.dtype, device: torch.device, world: int) -> int | None:
        return 1

    @torch.no_grad()
    def fill(self, view: torch.Tensor, rank: int) -> None:
        view[0] = 1.0 if self.raised() else 0.0

    @torch.no_grad()
    def take(self, view: torch.Tensor) -> None:
        if view[0].item() > 0:
            self.on_any()


class Reached:
    """Which parameters some rank's backward reached this step: one slot a parameter, each rank adding 1 where its
    own did (counts up to the world size: exact). A parameter this rank's backward did not reach (a mixture of
    experts routes its batch elsewhere, a head used on some steps) gets the mean where another rank's did, and keeps
    no gradient where none did, as torch's DDP with find_unused_parameters gives: with its own gradient left None,
    the optimizer skipped it here and stepped it on the other ranks, and the replicas parted (a blind port's)."""

    def __init__(self, buckets) -> None:
        self.buckets = buckets  # gradsync's, in layout order: `arrived` flags per parameter this backward
        self.riding = False
        self.counts: torch.Tensor | None = None  # from the last exchange; None: not known (not riding)
        self._offsets = [0]
        for b in buckets:
            self._offsets.append(self._offsets[-1] + len(b.params))

    def slots(self, dtype: torch.dtype, device: torch.device, world: int) -> int | None:
        return self._offsets[-1]

    @torch.no_grad()
    def fill(self, view: torch.Tensor, rank: int) -> None:
        if all(False not in b.arrived for b in self.buckets):
            view.fill_(1.0)
        else:
            view.copy_(torch.tensor([a for b in self.buckets for a in b.arrived], dtype=view.dtype))
        self.counts = None

    @torch.no_grad()
    def take(self, view: torch.Tensor) -> None:
        self.counts = view

    def by_some(self, bucket: int, i: int) -> bool:
        """Whether some rank's backward reached parameter `i` of `bucket` (True when not known)."""
        return self.counts is None or bool(self.counts[self._offsets[bucket] + i] > 0)
