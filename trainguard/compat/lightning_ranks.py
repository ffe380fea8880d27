"""Every rank's part of Lightning's bookkeeping (its accumulated logged values, its metrics, its step output), gathered
inside each step without a wait of its own.

A replacement needs its own part, so every rank holds every rank's. The parts are a few numbers laid out the same
way on every rank (the same keys, the same metadata): the numbers travel as a float64 vector of a fixed capacity
riding in the step's gradient exchange (train/parallel/riders.py: no collective of their own), set before the backward
and read right before the update (an optimizer pre-hook, after trainguard's own: a failure there skips the update, as
a failed gradient exchange does), and the layout is checked by a digest sent with them. Where nothing can ride (a
bf16 model's last bucket, no exchange in the step) the vector goes in an all-gather of its own, whose capacity grows
as needed. A part whose layout differs between ranks, whose numbers a float64 cannot hold, or that outgrows the vector,
is sent whole instead (two more collectives, synchronous, on every rank together: each rank decides from the same
gathered headers).
"""

from __future__ import annotations

import hashlib
import json
import math

import torch
import torch.distributed as dist

from ..checkpoint.blob import pack, unpack
from ..checkpoint.codec import flatten_state, unflatten_state
from ..train.parallel.riders import RankRows
from ..worker.transfer import FloatGather, all_gather_bytes
from .lightning_results import on_cpu

FIRST_CAPACITY = 64  # float64 slots a rank sends in a gather of its own: a digest, a count, the numbers
RIDING_CAPACITY = 256  # the same, riding in the gradient exchange: fixed, since it sets the exchange's length
_EXACT = 2.0 ** 53  # integers a float64 holds exactly


def _digest(layout: str) -> float:
    return float(int.from_bytes(hashlib.sha256(layout.encode()).digest()[:6], "big"))  # < 2**48: exact as a float64


def _exact(t: torch.Tensor) -> bool:
    if t.dtype.is_complex:
        return False
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.numel() == 0:
        return True
    return bool(t.abs().max() < _EXACT)


def _layout(tensors: dict, meta: dict) -> str:
    spec = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors.items()]
    return json.dumps({"meta": meta, "spec": spec}, sort_keys=True)


class RankParts:
    """`model`: the trainguard `DataParallel` whose gradient exchange the parts ride in; None: no riding."""

    def __init__(self, model=None) -> None:
        self.capacity = FIRST_CAPACITY
        self.rows = RankRows(RIDING_CAPACITY) if model is not None else None
        if self.rows is not None:
            model.ride(self.rows)
        self.pending: tuple | None = None  # (snapshot, layout, count, this rank's vector, gather) of the step under way

    def start(self, part: dict) -> None:
        """This rank's part, sent to every rank (the gather finishes in `finish()`). Its tensors may be the live ones:
        their numbers are copied here."""
        tensors, meta = flatten_state(part, copy=False)
        layout = _layout(tensors, meta)
        count = sum(t.numel() for t in tensors.values()) if all(_exact(t) for t in tensors.values()) else -1
        riding = self.rows is not None and self.rows.riding
        mine = torch.zeros(self.rows.capacity if riding else self.capacity, dtype=torch.float64)
        mine[0], mine[1] = _digest(layout), count
        snapshot = None  # the part as it is now, where `mine` cannot hold it (else `mine` and the layout are)
        if 0 <= count <= mine.numel() - 2:
            at = 2
            for t in tensors.values():  # the numbers copied (and converted) into their places
                mine[at:at + t.numel()].copy_(t.detach().reshape(-1))
                at += t.numel()
        else:
            snapshot = on_cpu(part)
        if riding:
            self.rows.send(mine)
            self.pending = (snapshot, layout, count, mine, None)
        else:
            self.pending = (snapshot, layout, count, mine, FloatGather(mine, dist.group.WORLD))

    def finish(self) -> dict | None:
        """Every rank's part: {"layout", "values" [world, n]}, or {"packed": every rank's part as a blob}."""
        if self.pending is None:
            return None
        snapshot, layout, count, mine, gather = self.pending
        self.pending = None
        if gather is None:
            rows = self.rows.rows
            if rows is None:  # no exchange carried it (no backward this step): on its own
                rows = FloatGather(mine, dist.group.WORLD).finish()
        else:
            rows = gather.finish()
        counts = rows[:, 1]
        if bool((rows[:, 0] == rows[0, 0]).all()) and bool((counts == count).all()) and 0 <= count <= mine.numel() - 2:
            return {"layout": layout, "values": rows[:, 2:2 + count].clone()}
        needed = int(counts.max().item()) + 2
        if gather is not None and needed > self.capacity:  # every rank sees the same rows: it grows the same everywhere
            self.capacity = 1 << math.ceil(math.log2(needed))
        if snapshot is None:  # this rank's part fit: its numbers as they were taken, in its layout
            snapshot = rank_part({"layout": layout, "values": mine[2:2 + count].unsqueeze(0)}, 0)
        return {"packed": all_gather_bytes(pack(snapshot), dist.group.WORLD)}


def rank_part(parts: dict, rank: int) -> dict:
    """Rank `rank`'s part out of what `finish()` gathered (pure)."""
    if "packed" in parts:
        return unpack(parts["packed"][rank], "Lightning's logged values")
    layout = json.loads(parts["layout"])
    values = parts["values"][rank]
    tensors, at = {}, 0
    for name, dtype, shape in layout["spec"]:
        n = math.prod(shape)
        tensors[name] = values[at:at + n].to(getattr(torch, dtype)).reshape(shape)
        at += n
    return unflatten_state(tensors, layout["meta"])
