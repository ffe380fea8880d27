"""A captured committed state: what a checkpoint or a dying-gasp save writes.

It holds the state data-parallel ranks share (flattened, private copies) and the per-rank part
(progress, job seed) as a blob; `ranks` maps every rank of the job to its part (in data
parallelism every rank's part is the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class Snapshot:
    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict
    own: bytes
    ranks: dict[int, bytes] | None = field(default=None)  # every rank's own blob
