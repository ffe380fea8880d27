"""A sampler of the script's own on a trainguard.DataLoader: torchvision's RASampler, a length-bucketing batch
sampler (`batch_sampler=`), torch's own DistributedSampler left as it was.

trainguard cannot set such a sampler's position, but it can make the same pass again and drop its first items. So
`DataLoader(..., sampler=S)` or `(..., batch_sampler=S)` wraps S in an `OwnSampler`, which torch iterates in its
place; attributes (`set_epoch`, `epoch`, `len`) are S's. For the training loader's pass, the order is drawn whole
when the pass begins, with torch's, Python's and NumPy's global streams seeded from a key of (job seed, rank, loader,
epoch) and put back after: whatever S draws from (a generator of its own seeded from its epoch, or the global
streams: torch's RandomSampler), the order is a function of the key and of what the script set on S, the same in a
run after a fault wherever the pass is made again. A resumed pass drops the order's first items up to the committed
position: indices, not samples, nothing is loaded. To loader workers the items go as SampleKeys seeded by their place
in the pass (loaderseed.py), not by their index: RASampler repeats each index, and each repeat is augmented anew.

What it needs: a length (an endless sampler's order cannot be drawn ahead), and one world (the elastic strategy and
virtual shards split the data again, which only trainguard's sampler can). Both are refused at the first step.
A pass of any other loader (eval) iterates S as torch would.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from ...errors import ConfigError
from ..state.streams import set_stream_states, stream_states
from .loaderseed import SampleKey, place_seed

_OWN = ("inner", "unit", "key", "skip", "keys_seed", "last")


class OwnSampler:
    """A script's sampler (`unit` "sample") or batch sampler (`unit` "batch"), made resumable (module docstring)."""

    def __init__(self, inner, unit: str) -> None:
        object.__setattr__(self, "inner", inner)
        self.unit = unit
        self.key: int | None = None  # the training pass's key: its order is drawn from it; None: S as it is
        self.skip = 0  # items of the pass to drop (a resumed position)
        self.keys_seed: int | None = None  # set with loader workers: items go out as SampleKeys (loaderseed.py)
        self.last: tuple[tuple, list] | None = None  # ((key, epoch), order) of the last pass drawn

    def __getattr__(self, name):
        if name == "inner":  # not yet set (a copy being made)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name, value) -> None:
        object.__setattr__(self, name, value) if name in _OWN else setattr(self.inner, name, value)

    def __len__(self) -> int:
        return len(self.inner)

    def begin(self, key: int | None, skip: int = 0) -> None:
        """The next pass: drawn from `key` (None: S as torch would iterate it), its first `skip` items dropped."""
        self.key, self.skip = key, skip

    def __iter__(self):
        if self.key is None:
            return iter(self.inner)
        mark = (self.key, getattr(self.inner, "epoch", None))  # the pass: its key and the script's set_epoch
        if self.last is None or self.last[0] != mark:  # torch asks a loader's iterator for its sampler's twice: one
            self.last = (mark, drawn(self.inner, self.key))  # draw a pass, and `skip` stays until the next begin()
        return self._walk(self.last[1], self.skip, self.key if self.keys_seed is not None else None)

    @staticmethod
    def _walk(order: list, skip: int, key: int | None):
        for place in range(skip, len(order)):
            yield order[place] if key is None else _keyed(order[place], key, place)


def drawn(sampler, key: int) -> list:
    """`sampler`'s whole pass, drawn with the global random streams seeded from `key`, which are put back after."""
    saved = stream_states()
    try:
        random.seed(key)  # not seed_streams(): CUDA's stream, which a sampler does not draw from, is left alone
        np.random.seed(key % (1 << 32))
        torch.default_generator.manual_seed(key)
        return list(sampler)
    finally:
        set_stream_states(saved)


def _keyed(item, key: int, place: int):
    if isinstance(item, int) and not isinstance(item, bool):
        return SampleKey(item, place_seed(key, place))
    if isinstance(item, list) and all(isinstance(i, int) for i in item):
        return [SampleKey(i, place_seed(key, place, j)) for j, i in enumerate(item)]
    return item  # something else than indices: as it is


def wrap(kwargs: dict, dataset, sharded: type) -> dict:
    """A DataLoader's keyword arguments, with a sampler or batch sampler of the script's own wrapped."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return kwargs
    for name, unit in (("batch_sampler", "batch"), ("sampler", "sample")):
        given = kwargs.get(name)
        if given is not None and not isinstance(given, (sharded, OwnSampler)) and not _plain(given):
            return {**kwargs, name: OwnSampler(given, unit)}
    return kwargs


def _plain(sampler) -> bool:
    """torch's samplers that read the whole dataset on every rank: as before, the training loader refuses them."""
    return type(sampler) in (torch.utils.data.SequentialSampler, torch.utils.data.RandomSampler)


def own_sampler(loader) -> OwnSampler | None:
    """The OwnSampler of a DataLoader, as its sampler or its batch sampler, or None."""
    for s in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
        if isinstance(s, OwnSampler):
            return s
    return None


def refuse_unresumable(own: OwnSampler, *, elastic: bool, virtual: bool) -> None:
    """ConfigError unless the training loader's own sampler can make its pass again in this job."""
    name = type(own.inner).__name__
    if elastic or virtual:
        what = "the elastic recover strategy" if elastic else "--virtual-shards"
        raise ConfigError(f"the loader that drives the training steps has a sampler of the script's own ({name}), "
                          f"which splits the data over the ranks its own way: {what} splits it again at another "
                          "world size, which only trainguard's sampler can. Use sampler=trainguard.DistributedSampler("
                          "dataset), or another recover strategy")
    try:
        len(own.inner)
    except TypeError:
        raise ConfigError(f"the loader that drives the training steps has a sampler of the script's own ({name}) "
                          "without a length (an endless sampler): trainguard draws each pass's order when it begins, "
                          "to resume it at the committed batch. Give the sampler __len__ (one pass), or use "
                          "sampler=trainguard.DistributedSampler(dataset)") from None
