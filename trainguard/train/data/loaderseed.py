"""Randomness in DataLoader workers, the same in every run: a recovery cannot change an augmentation.

A loader with `num_workers > 0` draws its random transforms in worker processes, whose streams torch
seeds once, when the iterator starts (a base seed drawn from the main process's stream, plus the worker's
number), and which then advance over the batches each worker happens to fetch (batch b goes to worker
b mod W, counted from the iterator's start). After a recovery the training loader's iterator starts
again in the middle of an epoch, at another point of the main stream and with another batch on worker 0:
every later sample was drawn differently, and the job ended with silently different weights (seen with
3 ranks, kill -9 mid-epoch, noise added in `__getitem__`). In the main process (`num_workers=0`) the
step's seed already covers it.

So each sample is drawn from its own seed, a function of (job seed, epoch, sample index) alone
(`sample_seed`): the same in every run, whatever worker fetches it and wherever the iterator started.
The sampler (trainguard's DistributedSampler or ShardedSampler) yields each index as a `SampleKey`, an
`int` that carries the seed, and each loader worker (its `worker_init_fn`, after the script's own) makes
its copy of the dataset seed Python's, NumPy's and torch's streams from the key before each `dataset[i]`.
A dataset's own `__getitems__` (whole-batch fetching) is turned off in the workers for that: one
`__getitem__` a sample.
In the main process (`num_workers=0`) nothing changes either, but under virtual shards: there a fetch's key is
the rank's, and a rank fetches several shards' samples at once, so the dataset is seeded per sample there too
(its draws then follow the sample wherever its shard runs). A dataset indexed with a plain int behaves as before.
Both the training wrappers' `trainguard.DataLoader` and the Session's loader (`TrainState(loader=...)`) do this
(`seed_loader_samples`) each time an iterator starts.
"""

from __future__ import annotations

import hashlib
import logging

import torch

from ..state.streams import SEED_RANGE, seed_streams

log = logging.getLogger("trainguard.loaders")


class SampleKey(int):
    """A sample's index, as trainguard's sampler hands it to loader workers, with the sample's seed."""

    seed: int

    def __new__(cls, index: int, seed: int) -> "SampleKey":
        key = super().__new__(cls, index)
        key.seed = seed
        return key

    def __reduce__(self):
        return SampleKey, (int(self), self.seed)


def sample_seed(job_seed: int, epoch: int, index: int) -> int:
    """The seed of sample `index`'s draws in `epoch` (pure; no rank, no position: the same in every run)."""
    return _seed_of(f"sample:{job_seed}:{epoch}:{index}")


def place_seed(key: int, place: int, j: int = 0) -> int:
    """The seed of the `j`-th sample of item `place` of a pass keyed `key` (ownsampler.py: a sampler of the script's
    own may repeat an index, so its samples are seeded by their place, not their index; pure)."""
    return _seed_of(f"place:{key}:{place}:{j}")


def _seed_of(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") % SEED_RANGE


def seed_loader_samples(loader, sampler, job_seed: int | None, *, in_main: bool = False) -> None:
    """Before an iterator of `loader` starts: with workers, its sampler (trainguard's) yields SampleKeys and
    each worker seeds per sample (after the script's own `worker_init_fn`). Without workers, only `in_main`
    (virtual shards): the dataset seeds per sample in this process. Idempotent; nothing before the job has its
    seed."""
    if (loader.num_workers == 0 and not in_main) or sampler is None or job_seed is None:
        return
    sampler.keys_seed = job_seed
    if loader.num_workers == 0:
        seed_each_sample(loader.dataset)
        return
    if not isinstance(loader.worker_init_fn, SeedSamplesInWorker):
        loader.worker_init_fn = SeedSamplesInWorker(loader.worker_init_fn)


class SeedSamplesInWorker:
    """A loader's `worker_init_fn`: the script's own (if any), then the per-sample seeding of this worker's
    dataset copy. Picklable (spawn) when the script's function is."""

    def __init__(self, then=None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        if self.then is not None:
            self.then(worker_id)
        seed_each_sample(torch.utils.data.get_worker_info().dataset)


def seed_each_sample(dataset) -> None:
    """Make `dataset` (a worker's copy, or under virtual shards the main process's) seed the global streams from
    each SampleKey it is indexed with; a plain index is fetched as before."""
    cls = type(dataset)
    if getattr(cls, "_tg_seeds_samples", False):
        return

    def __getitem__(self, key):
        if isinstance(key, SampleKey):
            seed_streams(key.seed)
            key = int(key)
        return cls.__getitem__(self, key)

    seeded = type(cls.__name__, (cls,), {"__getitem__": __getitem__, "__getitems__": None, "_tg_seeds_samples": True,
                                         "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    try:
        dataset.__class__ = seeded
    except TypeError as exc:  # a class whose instances cannot change class (built in C)
        log.warning("%s cannot be seeded per sample (%s): its random draws after a recovery or a change of world "
                    "size may differ from an uninterrupted run's", cls.__name__, exc)
