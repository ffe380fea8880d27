"""Drop-in loaders for a hand-written loop: any number of them, one of which drives the steps.

`trainguard.DataLoader` is torch's DataLoader (any sampler, `num_workers > 0` too). Each one gets a
number in the order the script makes them, the same in every run of the script (a replacement, a
rewind). The loader whose batches lead to `optimizer.step()` is the *training loader*; the job
learns which one it is at the first commit and keeps it with its state. It follows the committed
position: after a recovery it goes on from the committed batch, and when its pass over an epoch
is done the job stays at that epoch's end until the loader starts the next pass (so the code
after the epoch's batches, an eval pass, is where a fault in it comes back to). It needs
`trainguard.DistributedSampler` (the position must be settable), or reads an IterableDataset (a stream, one
per rank and loader worker), which has no position to set: its pass is read again up to the committed batch,
from an iterator whose workers' base seed is keyed, so a stream that is a function of (seed, rank, worker)
gives the same batches; a stream that keeps its own position (`state_dict()`/`load_state_dict()`, the protocol of
torchdata's StatefulDataLoader) resumes from a saved state near it instead (train/data/streamstate.py). Every other
loader (eval, test)
is a plain torch loader whose pass simply starts again when the script comes back to it; each of
its batches is also a point where a rank notices that the cluster moved on.
"""

from __future__ import annotations

import sys
import time

import torch

from ...errors import ConfigError
from ..engine import guard as guard_mod
from ..engine import rewind as rewind_mod
from ..state.streams import fetch_pass, key_seed
from . import numbering, ownsampler, passes, streamstate
from .loaderseed import seed_loader_samples
from .plainloaders import Resumable
from ...worker import runtime as rt_mod
from ..parallel.exactsum import shard_range
from .sampler import ShardedSampler, sharded_sampler


class DistributedSampler(ShardedSampler):
    """A drop-in for torch's DistributedSampler (num_replicas, rank, shuffle, seed, drop_last) that can
    resume mid-epoch; shards follow the current generation."""

    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False):
        super().__init__(dataset, num_shards=num_replicas, shard_id=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.dataset = dataset

    # torch's DistributedSampler's attributes, which subclasses (a bucketing sampler) and scripts read
    num_replicas = property(lambda self: self.num_shards)
    rank = property(lambda self: self.shard_id)
    num_samples = property(lambda self: len(self))
    total_size = property(lambda self: len(self) * self.num_shards)


class DataLoader(torch.utils.data.DataLoader, Resumable):
    """A drop-in for torch's DataLoader; see the module docstring. Under virtual shards a loader with a
    DistributedSampler hands this rank's shards' batches together (`batch_size` samples each, shard after shard):
    split them with `micro_batches`."""

    def __init__(self, *args, **kwargs):
        sampler, here = kwargs.get("sampler"), shards_here()
        self.tg_virtual = here is not None and isinstance(sampler, ShardedSampler)  # main-process draws per sample too
        if self.tg_virtual:
            batch = kwargs.pop("batch_size", args[1] if len(args) > 1 else 1)
            sampler.set_virtual(rt_mod.current().cfg.virtual_shards, here, batch)
            args, kwargs = args[:1] + args[2:], {**kwargs, "batch_size": batch * len(here)}
        super().__init__(*args, **ownsampler.wrap(kwargs, args[0] if args else kwargs.get("dataset"), ShardedSampler))
        self.tg_index = rewind_mod.next_loader_index()
        self.tg_kept = streamstate.attach(self)  # a stream that keeps its own position: its workers' states
        numbering.install()  # enumerate(loader) over a resumed pass counts from its batch (numbering.py)

    def __iter__(self):
        return guarded_iter(self, self._before_pass)

    def _before_pass(self, session) -> None:
        own = ownsampler.own_sampler(self)
        seed_loader_samples(self, sharded_sampler(self) or own, session.streams.seed, in_main=self.tg_virtual)
        if own is not None:  # the first pass, before the first commit, may be the training loader's: drawn keyed
            own.begin(pass_key(session, self) if session.train_loader in (None, self.tg_index) else None)

    def plain_iter(self):
        return super().__iter__()

    def quiet_iter(self, session, anchor: dict | None = None):
        """torch's iterator, made without moving the global random stream. A stream's is made from a keyed one: the
        base seed of its workers, which torch draws as the iterator is made, is then the same in every run. A stream
        that keeps its own position starts from `anchor` (streamstate.py)."""
        if not is_stream(self):
            return _quietly(self.plain_iter)
        key = key_seed(session.streams.seed or 0, session.rt.rank, f"stream/{self.tg_index}/{session.epoch}")
        if self.tg_kept is not None:
            return _quietly(lambda: streamstate.kept_pass(self, session, anchor), key)
        return _quietly(self.plain_iter, key)


def micro_batches(*batch):
    """One step's batch, split into the micro-batch of each virtual shard this rank holds (`--virtual-shards`): run
    a forward and a backward for each, then `optimizer.step()` once; don't divide the loss, the exchange averages
    over the shards. Without virtual shards, the batch itself, once. Tensors, and tuples, lists or dicts of them."""
    here = shards_here()
    n = len(here) if here is not None else 1
    for i in range(n):
        part = [_part(x, i, n) for x in batch]
        if here is not None:
            _shard_draws(here[i])
        yield part[0] if len(part) == 1 else tuple(part)


def _shard_draws(shard: int) -> None:
    """What the loop draws between handing out a shard's micro-batch and its forward (noise, a mixup of the
    micro-batch) is the shard's, the same at every world size (train/state/streams.py)."""
    guard = guard_mod.active()
    if guard is not None and guard.session is not None:
        guard.session.streams.shard_batch(guard.session.step, shard)


def shards_here() -> range | None:
    """The virtual shards this rank holds in this generation (`--virtual-shards`), or None without them."""
    rt = rt_mod.active()
    return shard_range(rt.cfg.virtual_shards, rt.world_size, rt.rank) if rt and rt.cfg.virtual_shards else None


def _part(x, i: int, n: int):
    if isinstance(x, torch.Tensor):
        if len(x) % n:
            raise ConfigError(f"a batch of {len(x)} cannot be split into {n} virtual shards' micro-batches")
        return x[i * (len(x) // n):(i + 1) * (len(x) // n)]
    if isinstance(x, dict):
        return {k: _part(v, i, n) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_part(v, i, n) for v in x)
    return x


def guarded_iter(loader, before=None):
    """A pass of one of trainguard's loaders (`loader` has `tg_index`, `plain_iter()` and `quiet_iter(session)`): a
    plain pass outside training, else the training loader's pass from the committed position, else another loader's
    pass with a check per batch. `before(session)` runs once the job has started, before the pass is made."""
    guard = guard_mod.active()
    if guard is None:  # not training under a guard: a plain loader
        return loader.plain_iter()
    session = guard.ensure_started()
    if before is not None:
        before(session)  # e.g. random draws in workers (loaderseed.py)
    if session.train_loader != loader.tg_index:
        return _OtherBatches(loader, guard)
    refuse_unresumable(loader, elastic=session.strategy.elastic)
    session.state.loader = loader
    if isinstance(getattr(loader, "sampler", None), ShardedSampler):
        session.sampler = loader.sampler
    return _TrainingBatches(loader, guard)


class _OtherBatches:
    """A pass of a loader that does not drive the steps: torch's iterator, with a check per batch."""

    def __init__(self, loader: DataLoader, guard: "guard_mod.Guard"):
        self.loader, self.guard = loader, guard
        self.label = pass_label(loader)
        # before the first commit this may be the training loader's first pass: its fetches are keyed (streams.py)
        self.fetches = _Fetches(loader, guard.session.epoch) if guard.session.train_loader is None else None
        self.it = loader.quiet_iter(guard.session) if is_stream(loader) else loader.plain_iter()

    def __iter__(self):
        return self

    def __next__(self):
        session = self.guard.session
        trains = session.train_loader == self.loader.tg_index  # the first commit named this pass's loader
        if trains:  # now, not at the first fault; before a peer's own refusal can look like a fault here
            refuse_unresumable(self.loader, elastic=session.strategy.elastic)
        self.guard.poll()
        if trains:
            session.passes.name(self.label)  # so that a loop resumed in another epoch's pass is told
        try:
            batch = next(self.it) if self.fetches is None else self.fetches.take(session, self.it)
        except StopIteration:
            if trains and passes.pass_done(taken(self.guard), self.loader):
                session.passes.end(session.state)  # its next pass begins the next epoch
            raise
        if trains:
            _took_training_batch(self.guard, batch, self.loader)
        else:
            self.guard.training_batch(self.loader.tg_index, counts_ahead(self.loader))
        return batch


class _TrainingBatches(numbering.ResumedPass):
    """A pass of the training loader, from the committed position: its batch `first` of the epoch (a framework's
    loader, which counts its own batches, says 0)."""

    def __init__(self, loader: DataLoader, guard: "guard_mod.Guard"):
        self.loader, self.guard = loader, guard
        session = guard.session
        self.restores = session.restores
        label = pass_label(loader)  # a stream has no set_epoch: one label
        done = passes.pass_done(taken(guard), loader)  # with the step's batches so far
        if (session.passes.ended and done) or session.passes.next_pass(label, done):
            session.roll_epoch(session.epoch + 1)  # the next epoch's pass begins (set_epoch's number is only its label)
            guard.batches.new_pass()
        else:
            session.passes.begun_at_end = done  # resumed after the epoch's last batch: the loop body runs for none
        session.passes.begin(label, step=session.step, epoch=session.epoch, in_epoch=session.in_epoch)
        self.it = self._from_position()
        self.first = 0 if getattr(loader, "replays_pass", False) else session.in_epoch
        self.begun()  # an enumerate over a generator that began this pass counts from `first` (numbering.py)

    def _from_position(self):
        session, loader = self.guard.session, self.loader
        if not replays(loader):
            own = ownsampler.own_sampler(loader)
            per = 1 if own is not None and own.unit == "batch" else loader.batch_size or 1  # None: a sample a batch
            if own is not None:
                own.begin(pass_key(session, loader), session.in_epoch * per)
            else:
                loader.sampler.set_position(session.in_epoch * per)
            self.fetches = _Fetches(loader, session.epoch, session.in_epoch)  # each fetch is keyed (streams.py)
            return loader.quiet_iter(session)
        # no position to set: read the pass again up to the committed batch, from a saved state where the stream
        # keeps one (streamstate.py), else from the pass's start
        anchor = streamstate.resume_point(loader, session)
        start = anchor["at"] if anchor is not None else 0
        it = loader.quiet_iter(session, anchor)
        self.fetches = _Fetches(loader, session.epoch, start)
        t0 = time.monotonic()
        last = None
        for _ in range(session.in_epoch - start):
            last = self.fetches.take(session, it)
        if getattr(loader, "replays_pass", False):
            loader.last_replayed = last  # the committed step's last batch, for a framework that ends that step
        if session.in_epoch:  # every rank that resumed says it: under a recovery in a step, only the replacement did
            what = "stream" if is_stream(loader) else "loader"
            since = (f"from its state saved at batch {start}, the {session.in_epoch - start} batches after it"
                     if anchor is not None else f"its first {session.in_epoch} batches")
            print(f"trainguard: rank {session.rt.rank}: the training {what} resumed at batch {session.in_epoch} of its "
                  f"pass: {since} were read again and dropped in {time.monotonic() - t0:.2f} s", file=sys.stderr,
                  flush=True)
        return it

    def __iter__(self):
        return self

    def __next__(self):
        guard, session = self.guard, self.guard.session
        guard.poll(between=True)
        if session.restores != self.restores:  # recovered in place (started by hand): from the committed position
            self.restores = session.restores
            guard.batches.restore(session.passes.ahead)
            self.it = self._from_position()
        try:
            batch = self.fetches.take(session, self.it)
        except StopIteration:
            if passes.pass_done(taken(guard), self.loader):
                session.passes.end(session.state)
            raise
        _took_training_batch(guard, batch, self.loader)
        return batch


class _Fetches:
    """A pass of the training loader, fetched with each batch's draws keyed by its place in the pass (streams.py)."""

    def __init__(self, loader, epoch: int, start: int = 0) -> None:
        self.point, self.place = fetch_pass(loader.tg_index, epoch), start

    def take(self, session, it):
        session.streams.fetch(self.point, self.place)
        self.place += 1
        return next(it)


def counts_ahead(loader) -> bool:
    """A batch the loop takes from `loader` ahead of its forward is the next step's (batches.py); a framework's loader
    fetches ahead inside its own iterator, or its integration accounts for it, so each of its fetches counts."""
    return not getattr(loader, "replays_pass", False)


def _took_training_batch(guard, batch, loader) -> None:
    if guard.batches.took(counts_ahead(loader)) and not guard.in_step:  # one taken ahead before a restore: no step
        guard.begin_step(batch, loader=loader.tg_index)


def taken(guard) -> int:
    """The training loader's batches of this pass taken so far: the committed steps', then those since."""
    return guard.session.in_epoch + guard.batches.pending()


def end_pass(loader) -> None:
    """The script's loop took the training loader's whole pass without running its iterator to the end (a loop that
    counts its batches, as the transformers Trainer's does): the pass is over, as if the iterator had ended. Call it
    where the code after the epoch's batches begins (the hyperparameters then are those of the pass's end)."""
    guard = guard_mod.active()
    session = guard.session if guard is not None else None
    if session is not None and session.train_loader == loader.tg_index and passes.pass_done(session.in_epoch, loader):
        session.passes.end(session.state)


def pass_key(session, loader) -> int:
    """The key of this rank's pass of `loader` over the session's epoch (a sampler of the script's own draws from it)."""
    return key_seed(session.streams.seed or 0, session.rt.rank, f"pass/{loader.tg_index}/{session.epoch}")


def pass_label(loader) -> int:
    """The number the script gave the pass with `set_epoch` (its sampler's or its batch sampler's), else 0."""
    label = getattr(loader.sampler, "epoch", None)
    return label if label is not None else getattr(getattr(loader, "batch_sampler", None), "epoch", 0)


def is_stream(loader) -> bool:
    return isinstance(loader.dataset, torch.utils.data.IterableDataset)


def replays(loader) -> bool:
    """The loader resumes by reading its pass again up to the committed batch: a stream, or a framework's own loader
    (train/data/replayed.py), neither of which has a position to set."""
    return is_stream(loader) or getattr(loader, "replays_pass", False)


def refuse_unresumable(loader, *, elastic: bool) -> None:
    """ConfigError unless the loader that drives the steps can resume at the committed batch."""
    if replays(loader):
        if elastic:
            what = "reads an IterableDataset (a stream)" if is_stream(loader) else "is a framework's own loader"
            raise ConfigError(f"the loader that drives the training steps {what}, which each rank reads its own "
                              "share of: the elastic recover strategy, which changes the ranks, cannot split it "
                              "again. Use a map-style dataset with trainguard.DistributedSampler, or another recover "
                              "strategy")
        return
    own = ownsampler.own_sampler(loader)
    if own is not None:
        ownsampler.refuse_unresumable(own, elastic=elastic, virtual=shards_here() is not None)
        return
    if not isinstance(loader.sampler, ShardedSampler):
        name = type(loader.sampler).__name__
        raise ConfigError(f"the loader that drives the training steps has no distributed sampler ({name}: every "
                          "rank would read the whole dataset): give it sampler=trainguard."
                          "DistributedSampler(dataset), whose position trainguard restores after a failure (or a "
                          "distributed sampler or batch sampler of the script's own, passed by keyword)")


def _quietly(make, seed: int | None = None):
    """Build an iterator without moving torch's global random stream (the step's stream is seeded); with `seed`,
    from a stream seeded so."""
    state = torch.get_rng_state()
    try:
        if seed is not None:
            torch.default_generator.manual_seed(seed)
        return make()
    finally:
        torch.set_rng_state(state)
