"""In-memory snapshots: the last few committed steps, held in CPU memory.

Each snapshot has the state data-parallel ranks share (flattened, private copies) and this
rank's own part (RNG, progress) as a blob. Once replicated, it also holds every rank's own
part, so any survivor can rebuild a lost rank at that step.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class Snapshot:
    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict
    own: bytes
    ranks: dict[int, bytes] | None = field(default=None)  # every rank's own blob, once replicated
    nodes: tuple[str, ...] = ()  # node id of each rank of its generation (elastic: ranks can move)


class SnapshotStore:
    def __init__(self, keep: int = 2):
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.keep = keep
        self._snaps: OrderedDict[int, Snapshot] = OrderedDict()

    def put(self, snap: Snapshot) -> None:
        self._snaps.pop(snap.step, None)
        self._snaps[snap.step] = snap
        while len(self._snaps) > self.keep:
            self._snaps.popitem(last=False)

    def get(self, step: int) -> Snapshot | None:
        return self._snaps.get(step)

    def drop_after(self, step: int) -> None:
        for s in [s for s in self._snaps if s > step]:
            del self._snaps[s]

    def report(self) -> list[list]:
        """[[step, replicated], ...] for the restore agreement."""
        return [[s, snap.ranks is not None] for s, snap in self._snaps.items()]
