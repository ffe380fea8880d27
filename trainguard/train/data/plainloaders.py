"""torch's own DataLoaders under trainguard: their worker processes at a rewind, and a loader the job cannot resume.

A rewind leaves the script's run behind (train/engine/rewind.py). The loader iterators of that run that have
worker processes must be ended then, explicitly: the script's objects form cycles, so the collector would
finalise them, and it does so after multiprocessing has closed their queues; torch's iterator then waits 5 s
for each worker to see a stop it never receives (10 s of every recovery with 2 workers). That holds for
trainguard's DataLoader and torch's alike, so every such iterator alive at the rewind is ended.

trainguard puts its own DataLoader back at the committed batch. A torch DataLoader starts its epoch from the
first batch again: if it feeds the training steps, a job resumed mid-epoch trains that epoch's first batches
twice and ends with other weights than a run without a fault. The job cannot tell a training loader from an
eval loader that happens to be torch's, so a restore mid-epoch with no trainguard DataLoader driving the steps
and a torch one in the process is said loudly (`mid_epoch_warning`).
"""

from __future__ import annotations

import gc

from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter  # torch has no public name for it


class Resumable:
    """The mark of trainguard's DataLoader (train/data/loaders.py), which resumes at the committed batch."""


def end_workers() -> int:
    """End the worker processes of every loader iterator of the process (what its __del__ would do, while its
    queues are still open); returns how many iterators had some."""
    ended = 0
    for obj in gc.get_objects():
        if issubclass(type(obj), _MultiProcessingDataLoaderIter):  # not isinstance: some __class__ warns
            obj._shutdown_workers()  # torch's own end of an iterator's workers; it has no public one
            ended += 1
    return ended


def torch_loaders() -> int:
    """How many of torch's DataLoaders (not trainguard's) the process holds."""
    return sum(1 for obj in gc.get_objects()
               if issubclass(type(obj), DataLoader) and not issubclass(type(obj), Resumable))


def mid_epoch_warning(step: int, epoch: int, in_epoch: int, loaders: int) -> str:
    """What rank 0 says when the job resumes mid-epoch and only torch's loaders are there to feed it (pure)."""
    return (f"trainguard: warning: the job resumes at step {step}, batch {in_epoch} of epoch {epoch}, but no "
            f"trainguard.DataLoader drives its steps, and the script has {loaders} torch.utils.data.DataLoader"
            f"{'s' if loaders != 1 else ''}. A torch DataLoader starts the epoch from its first batch again: if it "
            f"feeds the training steps, batches 0-{in_epoch - 1} of epoch {epoch} are trained twice and the weights "
            "differ from a run without the fault. Import DataLoader and DistributedSampler from trainguard (the "
            "same arguments)")
