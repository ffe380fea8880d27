"""The worker's part of the `elastic` recover strategy: the data phase and a returning node's state.

Under elastic the world size may change at a restore (fewer workers after a deadline, more
when one comes back). The data position is global: progress records the sampler's *phase*
(`Phase`): where in the epoch's global order it began (`base`), at which step of the epoch
(`start`) and over how many shards. A restore into another world size starts a new phase at
the first index of the epoch not yet consumed, so the rest of the epoch is split over the new
world and every index is still seen once (train/data/sampler.py).

A returning node needs no state of its own: it receives the shared state and progress from a
peer, and its random streams are re-seeded from (job seed, rank, step) like every rank's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("trainguard.session")


@dataclass(frozen=True, slots=True)
class Phase:
    base: int = 0  # offset in the epoch's global order where this phase began
    start: int = 0  # the step of the epoch (in_epoch) it began at
    shards: int = 0  # its world size (0: not recorded, i.e. the current one)

    def as_dict(self, world_size: int) -> dict:
        return {"base": self.base, "phase_start": self.start, "shards": self.shards or world_size}

    @classmethod
    def of(cls, progress: dict, world_size: int) -> "Phase":
        return cls(int(progress.get("base", 0)), int(progress.get("phase_start", 0)),
                   int(progress.get("shards", 0)) or world_size)


def reshard(phase: Phase, *, rt, sampler, loader, epoch: int, in_epoch: int) -> tuple[Phase, int, int]:
    """After a restore at (`epoch`, `in_epoch`): if the world size changed, a new phase holding the rest of the
    epoch. Returns (phase, epoch, in_epoch): an empty phase (nothing left for this world, e.g. fewer samples
    than shards with drop_last) ends the epoch."""
    if phase.shards == rt.world_size:
        return phase, epoch, in_epoch
    sampler.set_epoch(epoch)
    position = (in_epoch - phase.start) * (loader.batch_size or 1)  # batch_size=None: a sample a batch
    base = sampler.consumed(position, base=phase.base, num_shards=phase.shards)
    new = Phase(base, in_epoch, rt.world_size)
    sampler.set_phase(base, rt.world_size, rt.rank)
    log.info("rank %d: world size %d -> %d at epoch %d step %d: the rest of the epoch, from offset %d of its "
             "order, is re-sharded (%d samples for this rank)", rt.rank, phase.shards, rt.world_size, epoch,
             in_epoch, base, len(sampler))
    if rt.rank == 0:
        rt.events.emit("data_resharded", generation=rt.generation, epoch=epoch, in_epoch=in_epoch,
                       base=base, from_world=phase.shards, world_size=rt.world_size)
    if len(loader) == 0:  # nothing left for this world in this epoch
        return Phase(0, 0, rt.world_size), epoch + 1, 0
    return new, epoch, in_epoch
