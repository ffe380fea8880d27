"""A deterministic, resumable, sharded sampler.

Epoch ``e``'s global order is ``torch.randperm(N)`` drawn from a private
``torch.Generator().manual_seed(seed + e)`` (or ``range(N)`` without shuffle), padded by
repeating from the start until it divides evenly by ``num_shards`` (or truncated, with
``drop_last``). Shard ``k`` takes ``order[k::num_shards]``. The global torch RNG is never used.

Resuming: every shard of a data-parallel job moves in lockstep, so ``position`` (indices of
this shard already handed out in the current epoch) is the same on every rank. With a
``DataLoader(batch_size=B, num_workers=0)`` it equals ``batches_done * B``; with worker
processes the loader reads ahead of the training loop, so record ``batches_done * B`` yourself
and resume with ``set_position``.

Re-sharding mid-epoch (the elastic recover strategy): after ``p`` indices per shard, the epoch
has consumed a prefix of the global order, ``consumed(p)`` indices long. ``reshard_rest`` (or
``set_phase(base, ...)``) starts a new *phase* at that offset: the not-yet-consumed rest
``order[base:]`` is padded (or truncated) to divide by the new ``num_shards`` and shard ``k``
takes ``rest[k::num_shards]``, so every index of the epoch is still handed out exactly once
(up to the padding of the last phase). Positions count from the phase's start; a new epoch
starts at base 0.

Virtual shards (``set_virtual``; ``--virtual-shards V``, train/parallel/exactsum.py): virtual shard ``s`` takes
``order[s::V]``, padded (or truncated, with ``drop_last``) to whole steps of ``b`` samples; this rank's batch for
step ``j`` is its shards' ``j``-th ``b`` samples, shard after shard. The epoch's steps, and which samples each
shard trains at each step, are the same at every world size; nothing is re-sharded when the world changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch

from ...errors import ConfigError
from ...worker import runtime as rt_mod
from .loaderseed import SampleKey, sample_seed


def runtime_shards() -> tuple[int, int]:
    """(world size, rank) of this process's trainguard runtime; one shard, (1, 0), before trainguard.init()."""
    rt = rt_mod.active()
    return (rt.world_size, rt.rank) if rt is not None else (1, 0)


# Returns (world_size, rank), read when a sampler built without num_shards/shard_id first needs
# them (after trainguard.init(): this generation's); None means a single shard, (1, 0).
default_shard_info: Callable[[], tuple[int, int]] | None = runtime_shards


def _check_int(name: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"{name} must be an int >= {lo}, got {value!r}")
    return value


def _check_sharding(num_shards: Any, shard_id: Any, where: str = "") -> tuple[int, int]:
    _check_int(f"num_shards{where}", num_shards, 1)
    _check_int(f"shard_id{where}", shard_id, 0)
    if shard_id >= num_shards:
        raise ConfigError(f"shard_id{where} must be < num_shards ({num_shards}), got {shard_id}")
    return num_shards, shard_id


class ShardedSampler(torch.utils.data.Sampler[int]):
    """Yields this shard's dataset indices for the current epoch; see the module docstring."""

    def __init__(
        self,
        dataset_or_len: Sized | int,
        *,
        num_shards: int | None = None,
        shard_id: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        n = dataset_or_len if isinstance(dataset_or_len, int) else len(dataset_or_len)
        self._n = _check_int("dataset_or_len", n, 0)
        if (num_shards is None) != (shard_id is None):
            raise ConfigError(
                "num_shards and shard_id must be given together, or both left None to take "
                f"them from default_shard_info; got num_shards={num_shards!r}, shard_id={shard_id!r}"
            )
        self._num_shards: int | None = None
        self._shard_id: int | None = None
        if num_shards is not None:
            self._num_shards, self._shard_id = _check_sharding(num_shards, shard_id)
        self.shuffle = bool(shuffle)
        self.seed = _check_int("seed", seed, 0)
        self.drop_last = bool(drop_last)
        self._epoch = 0
        self._start = 0  # where the next __iter__ begins; one-shot
        self._position = 0  # indices handed out so far in the current epoch (in its current phase)
        self._base = 0  # global-order offset where the current phase starts (0 unless re-sharded mid-epoch)
        self.keys_seed: int | None = None  # the job seed: indices go out as SampleKeys (loaderseed.py)
        self.virtual: tuple[int, range, int] | None = None  # (V, this rank's shards, samples a shard a step)

    def set_virtual(self, shards: int, here: range, batch: int) -> None:
        """Hand out this rank's virtual shards' samples, `batch` a shard a step (module docstring)."""
        self.virtual = (shards, here, _check_int("batch_size", batch, 1))
        self._num_shards, self._shard_id = shards, here.start

    def _per_shard(self) -> int:
        """Samples a virtual shard takes in an epoch: whole steps of `batch`."""
        shards, _, batch = self.virtual
        if self.drop_last:
            return self._n // shards // batch * batch
        return math.ceil(math.ceil(self._n / shards) / batch) * batch

    # --- sharding -------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        self._resolve()
        return self._num_shards  # type: ignore[return-value]

    @property
    def shard_id(self) -> int:
        self._resolve()
        return self._shard_id  # type: ignore[return-value]

    def _resolve(self) -> None:
        if self._num_shards is not None:
            return
        hook = default_shard_info
        world, rank = hook() if hook is not None else (1, 0)
        self._num_shards, self._shard_id = _check_sharding(world, rank, " (from default_shard_info)")

    def _len_for(self, num_shards: int, base: int = 0) -> int:
        rest = self._n - base
        return rest // num_shards if self.drop_last else math.ceil(rest / num_shards)

    def _carry_position(self, old_shards: int, position: int, new_shards: int) -> int:
        """Map a position under ``old_shards`` to ``new_shards``: possible at epoch boundaries only
        (``reshard_rest`` re-shards mid-epoch)."""
        if new_shards == old_shards:
            return position
        if position == 0 and self._base == 0:
            return 0
        if position >= self._len_for(old_shards, self._base):
            return self._len_for(new_shards, self._base)
        raise ConfigError(
            f"cannot move from num_shards={old_shards} to num_shards={new_shards} mid-epoch "
            f"(epoch {self._epoch}, position {position} of {self._len_for(old_shards)}); "
            "change sharding between epochs, or resume with the same num_shards"
        )

    def reshard(self, num_shards: int, shard_id: int) -> None:
        """Use a new sharding from the next ``__iter__``; only at an epoch boundary."""
        num_shards, shard_id = _check_sharding(num_shards, shard_id)
        self._position = self._carry_position(self.num_shards, self._position, num_shards)
        self._start = min(self._start, self._position)
        self._num_shards, self._shard_id = num_shards, shard_id

    # --- epoch and position ---------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next pass hands out (shuffled with seed + epoch); a new epoch starts at
        position 0, the current one keeps its position. Under a trainguard loader the number is only the shuffle's
        label: the position is the job's (train/data/loaders.py)."""
        _check_int("epoch", epoch, 0)
        if epoch != self._epoch:
            self._epoch, self._start, self._position, self._base = epoch, 0, 0, 0

    def set_position(self, position: int) -> None:
        """Make the next ``__iter__`` start at this shard's ``position``-th index of the epoch.

        A position past the end (``batches_done * B`` after a short last batch) means the
        epoch is done."""
        _check_int("position", position, 0)
        self._start = self._position = min(position, len(self))

    # --- phases (re-sharding mid-epoch) -----------------------------------------
    @property
    def base(self) -> int:
        """Global-order offset of the epoch where the current phase began."""
        return self._base

    def consumed(self, position: int | None = None, *, base: int | None = None,
                 num_shards: int | None = None) -> int:
        """Indices of the epoch's global order handed out (over all shards) after ``position``
        indices per shard of the phase starting at ``base`` under ``num_shards`` (defaults: now)."""
        position = self._position if position is None else _check_int("position", position, 0)
        base = self._base if base is None else _check_int("base", base, 0)
        shards = self.num_shards if num_shards is None else _check_int("num_shards", num_shards, 1)
        if base > self._n:
            raise ConfigError(f"base must be <= the dataset length {self._n}, got {base}")
        return min(self._n, base + min(position, self._len_for(shards, base)) * shards)

    def set_phase(self, base: int, num_shards: int, shard_id: int) -> None:
        """Hand out ``order[base:]`` of the current epoch over a new sharding, from its start."""
        num_shards, shard_id = _check_sharding(num_shards, shard_id)
        _check_int("base", base, 0)
        if base > self._n:
            raise ConfigError(f"base must be <= the dataset length {self._n}, got {base}")
        self._num_shards, self._shard_id, self._base = num_shards, shard_id, base
        self._start = self._position = 0

    def reshard_rest(self, num_shards: int, shard_id: int, position: int | None = None) -> int:
        """Split the rest of the epoch (after ``position`` indices per shard, default: the current
        position) over ``num_shards``; returns the new phase's base."""
        base = self.consumed(position)
        self.set_phase(base, num_shards, shard_id)
        return base

    def state_dict(self) -> dict[str, int]:
        state = {
            "epoch": self._epoch,
            "position": self._position,
            "num_shards": self.num_shards,
            "shard_id": self.shard_id,
            "seed": self.seed,
        }
        if self._base:  # re-sharded mid-epoch
            state["base"] = self._base
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore epoch, position and seed. This sampler keeps its own sharding (the saved
        ``shard_id`` is informational, as positions are equal on every shard); a saved
        ``num_shards`` that differs is accepted only at an epoch boundary."""
        missing = {"epoch", "position", "num_shards", "seed"} - state.keys()
        if missing:
            raise ConfigError(f"sampler state is missing {sorted(missing)}; got keys {sorted(state)}")
        epoch = _check_int("state['epoch']", state["epoch"], 0)
        position = _check_int("state['position']", state["position"], 0)
        saved_shards = _check_int("state['num_shards']", state["num_shards"], 1)
        seed = _check_int("state['seed']", state["seed"], 0)
        base = _check_int("state['base']", state.get("base", 0), 0)
        if base > self._n:
            raise ConfigError(f"state['base'] must be <= the dataset length {self._n}, got {base}")
        if position > self._len_for(saved_shards, base):
            raise ConfigError(
                f"state['position'] must be <= {self._len_for(saved_shards, base)} for a dataset of "
                f"{self._n} with num_shards={saved_shards}, got {position}"
            )
        self._epoch, self.seed, self._base = epoch, seed, base
        self._start = self._position = self._carry_position(saved_shards, position, self.num_shards)

    # --- iteration ------------------------------------------------------------
    def _order(self, epoch: int | None) -> list[int]:
        epoch = self._epoch if epoch is None else epoch
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            return torch.randperm(self._n, generator=gen).tolist()
        return list(range(self._n))

    def _padded(self, order: list[int], base: int) -> list[int]:
        rest = order[base:]
        total = self._len_for(self.num_shards, base) * self.num_shards
        if total <= len(rest):
            return rest[:total]
        pad = total - len(rest)
        return rest + (order * math.ceil(pad / len(order)))[:pad]

    def global_order(self, epoch: int | None = None) -> list[int]:
        """Epoch's global order after padding/truncation (every shard's indices, interleaved)."""
        return self._padded(self._order(epoch), 0)

    def phase_order(self, epoch: int | None = None) -> list[int]:
        """The current phase's order: ``order[base:]`` padded/truncated to divide by ``num_shards``
        (the same as ``global_order`` when ``base`` is 0)."""
        return self._padded(self._order(epoch), self._base)

    def indices(self, epoch: int | None = None) -> list[int]:
        """This shard's full index list for an epoch (its current phase; its virtual shards' step by step)."""
        if self.virtual is None:
            return self.phase_order(epoch)[self.shard_id :: self.num_shards]
        (shards, here, batch), per = self.virtual, self._per_shard()
        order = self._order(epoch)
        order = (order * math.ceil(shards * per / max(1, len(order))))[:shards * per]
        return [order[s + shards * (j * batch + i)] for j in range(per // batch) for s in here for i in range(batch)]

    def __len__(self) -> int:
        if self.virtual is not None:
            return len(self.virtual[1]) * self._per_shard()
        return self._len_for(self.num_shards, self._base)

    def __iter__(self) -> Iterator[int]:
        mine = self.indices()
        start, self._start = self._start, 0
        self._position = start
        return self._walk(mine, start)

    def _walk(self, mine: list[int], start: int) -> Iterator[int]:
        seed, epoch = self.keys_seed, self._epoch
        for i in range(start, len(mine)):
            self._position = i + 1
            yield mine[i] if seed is None else SampleKey(mine[i], sample_seed(seed, epoch, mine[i]))

    def __repr__(self) -> str:
        shards = f"{self._shard_id}/{self._num_shards}" if self._num_shards else "lazy"
        base = f", base={self._base}" if self._base else ""
        return (
            f"ShardedSampler(n={self._n}, shard={shards}, shuffle={self.shuffle}, "
            f"seed={self.seed}, drop_last={self.drop_last}, epoch={self._epoch}, "
            f"position={self._position}{base})"
        )


def sharded_sampler(loader) -> ShardedSampler | None:
    """The ShardedSampler of a DataLoader (as its sampler or its batch sampler's), or None."""
    sampler = loader.sampler if isinstance(loader.sampler, ShardedSampler) else getattr(
        loader.batch_sampler, "sampler", None)
    return sampler if isinstance(sampler, ShardedSampler) else None


def sampler_of(loader) -> ShardedSampler | None:
    """The ShardedSampler of a DataLoader (as its sampler or its batch sampler's); ConfigError otherwise."""
    if loader is None:
        return None
    sampler = sharded_sampler(loader)
    if sampler is None:
        raise ConfigError("the loader's sampler must be trainguard.ShardedSampler so that the data position "
                          "can be restored after a failure: DataLoader(ds, batch_size=B, sampler=ShardedSampler(ds))")
    return sampler
