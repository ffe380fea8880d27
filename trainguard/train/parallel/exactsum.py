"""A gradient sum whose bits do not depend on the world size: V virtual data shards, added in one fixed tree.

Why the float sum over ranks cannot do it. The gradient exchange (gradsync.py) adds the ranks' gradients in
float, in an order fixed by its layout and the world size: the same world gives the same bits, another world
another order, and float addition is not associative. An elastic job that goes on at W-1 ranks (issue 41), or a
job restarted on fewer hosts, would train on other bits.

What it does instead. The global batch is defined over V fixed virtual shards; a rank of W holds the
contiguous range `shard_range(V, W, rank)` and runs one backward per shard. Each shard's gradient is kept as
it came out of its backward (the same bits wherever the shard runs, given its data and its random numbers).
The sum over the V shards is one fixed binary tree: node [a, b) is [a, m) + [m, b) with m the middle
(`split`), its leaves the shards. Every node's value is a pure function of its shards' gradients, computed by
the same float additions wherever it is computed, so the root is the same bits at every W:
- a rank adds up the largest nodes inside its own range itself (`cover`: one node when its range is a node of
  the tree, as when V is W times a power of two and the world is W or W/2; a few after a shrink);
- an all-to-all sends each rank's nodes, cut into W equal chunks, chunk j to rank j;
- rank j finds the whole tree's partition in what it received, in shard order, and folds it to the root for its
  chunk (`fold`), divides by V, and a second all-to-all hands every rank every chunk (an all-gather; gloo's
  all-to-all moves the same bytes in about half the time of its all-gather here).

The two collectives move what a ring all-reduce moves when every rank sends one node (a ring all-reduce is a
reduce-scatter and an all-gather); a rank that sends k nodes sends k times the first half. On two ranks that hold
one node each the root is a single addition, whose bits do not depend on the order of its two operands: an
all-reduce computes it exactly, so that case is DDP's exchange (`TreeSum.direct`). No conversion, no
exponent to agree on: the gradients are added as floats, in their own dtype, as DDP adds them. An inf or NaN
goes into the sum as it would into DDP's, on every rank alike (a GradScaler skips the step everywhere).

The bucket's pieces leave as its last shard's backward fills it (overlap, as DDP's buckets do); the previous
bucket's fold and all-gather follow each launch, so every rank issues the same collectives in the same order.

Measured against the other known way (bench/elastic_exact.py, 1.32M parameters, gloo on this machine's CPUs):
gradients as 64-bit fixed point with a shared exponent per bucket (agreed by an all-reduce(MAX)), summed as
integers, cost 1.73-2.67x DDP's step (twice the bytes, three passes of conversion, no overlap); this tree
0.94-1.04x (the README's benchmark section).

The exchange's tail (the control slots and what rides: gradsync.py) travels with the last bucket, in the all-reduce
or with the nodes: as a collective of its own it had cost 5-8% of the step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...errors import ConfigError


def shard_range(shards: int, world: int, rank: int) -> range:
    """The virtual shards rank `rank` of `world` holds: contiguous, the first `shards % world` ranks one more."""
    if not 1 <= world <= shards or not 0 <= rank < world:
        raise ValueError(f"{shards} virtual shards cannot be held by rank {rank} of {world}")
    base, extra = divmod(shards, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def split(node: range) -> tuple[range, range]:
    """A node's two children in the fixed tree: its shards cut in the middle (the left half the larger)."""
    if len(node) < 2:
        raise ValueError(f"tree node {node} is a leaf")
    middle = node.start + (len(node) + 1) // 2
    return range(node.start, middle), range(middle, node.stop)


def cover(here: range, shards: int) -> list[range]:
    """The largest nodes of the tree over `shards` that lie inside `here`, in shard order: they partition it."""
    out: list[range] = []

    def walk(node: range) -> None:
        if here.start <= node.start and node.stop <= here.stop:
            out.append(node)
        elif node.start < here.stop and here.start < node.stop:
            for child in split(node):
                walk(child)

    walk(range(shards))
    return out


def fold(node: range, given: dict[range, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The value of `node`: `given[node]` where given, else its children's values added (a new tensor, or `out`,
    written last: it may be one of the nodes given). The nodes given must partition `node`."""
    if node in given:
        value = given[node]
        return value if out is None or out.data_ptr() == value.data_ptr() else out.copy_(value)
    left, right = split(node)
    return torch.add(fold(left, given), fold(right, given), out=out)


class ShardSum:
    """This rank's shards' gradients for one step, bucket by bucket, and each bucket's sum over the tree: an earlier
    shard's are kept as its backward left them, the last one's buckets leave as they fill (`launch`). `buckets`:
    each bucket's (gradients' length, buffer); `tail`: the length of the last one's tail (TreeSum)."""

    def __init__(self, shards: int, world: int, rank: int, buckets: list[tuple[int, torch.Tensor]], tail: int):
        self.shards, self.here = shards, shard_range(shards, world, rank)
        self.trees = [TreeSum(shards, world, rank, size, room, tail if b == len(buckets) - 1 else 0)
                      for b, (size, room) in enumerate(buckets)]
        self.kept: list[list[torch.Tensor]] = []  # per earlier shard: a copy of each bucket's gradients

    @property
    def done(self) -> int:
        return len(self.kept)

    @property
    def in_last(self) -> bool:
        """The backward running now (or next) is this rank's last shard's."""
        return self.done == len(self.here) - 1

    def keep(self, grads: list[torch.Tensor]) -> None:
        """A shard's backward ended, not the last: a copy of its gradients; the buckets start from zero for the next
        (its own gradient, not a float sum)."""
        self.kept.append([g.clone() for g in grads])
        for g in grads:
            g.zero_()

    def launch(self, b: int, rooms: list[torch.Tensor], group) -> list:
        """Bucket b's nodes leave (the last bucket: once its tail is filled); then bucket b-1's root is taken and
        gathered (an all-reduce's result waits for the end: taking it launches nothing). Its works."""
        tree = self.trees[b]
        leaves = [shard[b] for shard in self.kept] + [rooms[b][:tree.size]]
        tree.launch({range(s, s + 1): g for s, g in zip(self.here, leaves)}, rooms[b], group)
        return self.trees[b - 1].gather(rooms[b - 1], group) if b and not tree.direct else []

    def gather_last(self, rooms: list[torch.Tensor], group) -> list:
        """After the last bucket's `launch`: the roots not taken yet. Their works."""
        direct = self.trees[-1].direct
        return [w for b in (range(len(self.trees)) if direct else [-1]) for w in self.trees[b].gather(rooms[b], group)]

    def land(self, rooms: list[torch.Tensor]) -> None:
        """Once every gather is in: the sums into the gradients (a bucket whose chunks were padded)."""
        for tree, room in zip(self.trees, rooms):
            tree.land(room)

    def clear(self) -> None:
        self.kept = []

    def unfinished(self) -> ConfigError:
        """The optimizer steps before this rank ran a backward for each of its shards."""
        return ConfigError(
            f"under --virtual-shards {self.shards} this rank holds shards {self.here.start}..{self.here.stop - 1} and "
            f"runs one forward and backward for each before optimizer.step(), but it ran {self.done}: split the "
            "step's batch with `for x, y in trainguard.micro_batches(x, y):`")


class TreeSum:
    """One bucket's sum over the tree (module docstring): `launch` sends the rank's nodes, `gather` takes this rank's
    chunk of the root and sends it to every rank, `land` puts a padded bucket's sums in place. Each works on the
    bucket's buffer (`room`): its gradients, the last shard's leaf, then the exchange's tail in the last bucket
    (gradsync.py: the control slots and the riders, each rank's values in its own slots and zeros elsewhere), then
    zeros up to W equal chunks. The tail goes to every rank with the nodes, and each adds up the W tails: exact, with
    one value a slot."""

    def __init__(self, shards: int, world: int, rank: int, size: int, like: torch.Tensor, tail: int = 0):
        self.shards, self.world, self.size, self.tail = shards, world, size, tail
        self.chunk = -(-size // world)
        self.covers = [cover(shard_range(shards, world, r), shards) for r in range(world)]
        self.mine = self.covers[rank]
        nodes = [node for held in self.covers for node in held]  # the tree's partition, in shard order
        # two nodes (two ranks, one each): the root is one addition, whose two operands give the same bits in either
        # order, so an all-reduce of the nodes computes it exactly (DDP's one collective, in place, with the tail)
        self.direct = len(nodes) <= 2
        self.out = like.new_empty(world * self.chunk) if self.chunk * world != size and not self.direct else None
        self.send, self.work = None, None  # `send`: made once the rank's nodes cannot leave from its bucket as is
        self.splits = [len(held) * self.chunk + tail for held in self.covers]  # from each rank: its nodes, its tail
        self.recv = like.new_empty(0 if self.direct else sum(self.splits))
        self.rows: dict[range, torch.Tensor] = {}
        self.tails: list[torch.Tensor] = []
        at = 0
        for held, n in zip(self.covers, self.splits):
            for k, node in enumerate(held):
                self.rows[node] = self.recv[at + k * self.chunk:at + (k + 1) * self.chunk]
            self.tails.append(self.recv[at + n - tail:at + n])
            at += n
        self.copies = like.new_empty(0 if self.direct else world * self.chunk).view(-1, self.chunk)  # the root's chunk
        # on this rank, once for every rank

    @staticmethod
    def padded_size(size: int, world: int) -> int:
        """A bucket's length rounded up to W equal chunks: its buffer is made at least this long, so that its last
        shard's gradients leave from it as they are."""
        return -(-size // world) * world

    def launch(self, leaves: dict[range, torch.Tensor], room: torch.Tensor, group) -> None:
        """The rank's nodes, each added up from its leaves, chunk j of each to rank j, with the tail."""
        grads = room[:self.size]
        if self.direct:
            fold(self.mine[0], leaves, out=grads)
            self.work = dist.all_reduce(room[:self.size + self.tail], group=group, async_op=True)
            return
        pieces = [fold(node, leaves) for node in self.mine]
        whole, mine = self.world * self.chunk, len(self.mine) * self.chunk
        if len(pieces) == 1 and not self.tail and room.numel() >= whole and room.data_ptr() == grads.data_ptr() \
                and pieces[0].data_ptr() == grads.data_ptr():
            send = room[:whole]  # what lies after the gradients travels in the padding, which no one lands
        else:
            if self.send is None:
                self.send = grads.new_zeros(self.world, mine + self.tail)  # zeros: the padding stays 0
            for k, piece in enumerate(pieces):
                _lay(piece, self.send[:, k * self.chunk:(k + 1) * self.chunk])
            self.send[:, mine:].copy_(room[self.size:self.size + self.tail].expand(self.world, self.tail))
            send = self.send
        self.work = dist.all_to_all_single(self.recv, send.reshape(-1), output_split_sizes=self.splits,
                                           input_split_sizes=[mine + self.tail] * self.world, group=group,
                                           async_op=True)

    def gather(self, room: torch.Tensor, group) -> list:
        """The root for this rank's chunk, over V, gathered from every rank into the bucket (or the padded buffer);
        the tails added into the bucket's. The gather's works."""
        self.work.wait()
        grads = room[:self.size]
        if self.direct:
            grads.div_(self.shards)  # not the tail: summed, not averaged
            return []
        if self.tail:
            total = room[self.size:self.size + self.tail].copy_(self.tails[0])
            for tail in self.tails[1:]:
                total.add_(tail)
        fold(range(self.shards), self.rows, out=self.copies[0])
        self.copies[0].div_(self.shards)
        self.copies[1:].copy_(self.copies[0].expand(self.world - 1, self.chunk))
        return [dist.all_to_all_single(grads if self.out is None else self.out, self.copies.view(-1), group=group,
                                       async_op=True)]

    def land(self, room: torch.Tensor) -> None:
        if self.out is not None:
            room[:self.size].copy_(self.out[:self.size])


def _lay(piece: torch.Tensor, rows: torch.Tensor) -> None:
    """piece's elements into `rows` (W rows of a chunk each, maybe columns of a wider buffer) in order; the rest of
    the last rows stays as it is."""
    chunk = rows.shape[1]
    full, rest = divmod(piece.numel(), chunk)
    rows[:full].copy_(piece[:full * chunk].view(full, chunk))
    if rest:
        rows[full, :rest].copy_(piece[full * chunk:])
