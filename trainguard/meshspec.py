"""The layout of a sharded job: a device mesh's shape, its dimension names, and which dimensions
replicate the state (pure; no torch).

Ranks are laid out row-major over the mesh (the last dimension fastest), as `init_device_mesh`
does. Two ranks hold the same training state exactly when their coordinates differ only along
replicate dimensions: the DP dimension of DP x TP, HSDP's replicate dimension. So every rank has a
*shard id* (its coordinates along the other dimensions) and a replica group (the ranks with its
shard id), the lists a sliced checkpoint's group info names.

A rank's *buddy* holds an in-memory copy of its state: the rank `k` places further on (cyclically),
with `k` the smallest shift that lands every rank on one holding another shard. A shift is a
permutation, so every rank holds exactly one other rank's copy; where every rank holds the same
state (pure data parallelism) no buddy is needed, and there is none.

    spec = MeshSpec((2, 2), ("dp", "tp"), replicate=("dp",))
    spec.shard_of(3) == 1; spec.replicas(0) == [0, 2]; spec.buddy(0) == 1
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True, slots=True)
class MeshSpec:
    shape: tuple[int, ...]
    names: tuple[str, ...]
    replicate: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "names", tuple(self.names))
        object.__setattr__(self, "replicate", tuple(self.replicate))
        if not self.shape or len(self.shape) != len(self.names):
            raise ConfigError(f"a mesh needs one name per dimension: shape {self.shape}, names {self.names}")
        if not all(type(n) is int and n >= 1 for n in self.shape):
            raise ConfigError(f"mesh shape {self.shape}: every dimension must be an integer >= 1")
        if len(set(self.names)) != len(self.names):
            raise ConfigError(f"mesh names {self.names} repeat a name")
        unknown = [n for n in self.replicate if n not in self.names]
        if unknown:
            raise ConfigError(f"replicate={self.replicate}: {unknown} are not dimensions of the mesh {self.names}")

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ConfigError(f"the mesh {self.describe()} needs {self.world_size} workers, but the job has "
                              f"{world_size}; run it with --workers {self.world_size}, or pick a mesh whose "
                              f"product is {world_size}")

    def describe(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in zip(self.names, self.shape))

    def coords(self, rank: int) -> tuple[int, ...]:
        out = []
        for size in reversed(self.shape):
            rank, c = divmod(rank, size)
            out.append(c)
        return tuple(reversed(out))

    def shard_of(self, rank: int) -> int:
        """The index of the state `rank` holds among the distinct ones (row-major over the other dimensions)."""
        shard = 0
        for name, size, c in zip(self.names, self.shape, self.coords(rank)):
            if name not in self.replicate:
                shard = shard * size + c
        return shard

    def replicas(self, rank: int) -> list[int]:
        """The ranks holding the same state as `rank` (itself included), ascending."""
        mine = self.shard_of(rank)
        return [r for r in range(self.world_size) if self.shard_of(r) == mine]

    def shards(self) -> "ShardMap":
        """Every rank's shard id, as a ShardMap (buddies, wards)."""
        return ShardMap(tuple(self.shard_of(r) for r in range(self.world_size)))

    def shift(self) -> int | None:
        return self.shards().shift()

    def buddy(self, rank: int) -> int | None:
        return self.shards().buddy(rank)

    def ward(self, rank: int) -> int | None:
        return self.shards().ward(rank)


@dataclass(frozen=True, slots=True)
class ShardMap:
    """Which shard of the state each rank holds (`ids[rank]`): ranks with the same id are replicas. From a
    MeshSpec, or from what the ranks of a sharded model report (train/parallel/sharding.py)."""

    ids: tuple[int, ...]

    @classmethod
    def of_keys(cls, keys) -> "ShardMap":
        """Shard ids numbered in the order their keys first appear, rank by rank."""
        number: dict = {}
        return cls(tuple(number.setdefault(k, len(number)) for k in keys))

    @property
    def world_size(self) -> int:
        return len(self.ids)

    def shard_of(self, rank: int) -> int:
        return self.ids[rank]

    def replicas(self, rank: int) -> list[int]:
        return [r for r, g in enumerate(self.ids) if g == self.ids[rank]]

    def shift(self) -> int | None:
        """The smallest k with every rank's state different from rank (r + k)'s; None: all the same."""
        n = len(self.ids)
        for k in range(1, n):
            if all(self.ids[r] != self.ids[(r + k) % n] for r in range(n)):
                return k
        return None

    def buddy(self, rank: int) -> int | None:
        """The rank that keeps `rank`'s in-memory copy."""
        k = self.shift()
        return None if k is None else (rank + k) % len(self.ids)

    def ward(self, rank: int) -> int | None:
        """The rank whose copy `rank` keeps (the inverse of buddy)."""
        k = self.shift()
        return None if k is None else (rank - k) % len(self.ids)
