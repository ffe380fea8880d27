"""A gradient sum whose bits do not depend on the world size: V virtual data shards, summed exactly.

Why floats cannot do it. The gradient exchange (gradsync.py) adds the ranks' gradients in float, in an
order fixed by its layout and the world size: the same world gives the same bits, another world another
order, and float addition is not associative. An elastic job that goes on at W-1 ranks (issue 41), or a
job restarted on fewer hosts, would train on other bits.

What it does instead. The global batch is defined over V fixed virtual shards; a rank of W holds the
contiguous range `shard_range(V, W, rank)` and runs one backward per shard. Each shard's gradient is
kept as it came out of its backward (the same bits wherever the shard runs, given its data and its
random numbers), then converted to fixed point with a shared exponent per bucket and added as 64-bit
integers, on the rank and across ranks. Integer addition is associative and exact, so the sum is
the same integers for every W and every placement of the shards; it is converted back once, and the
mean is that sum divided by V.

The exponent. Every shard's gradient in a bucket is scaled by 2**k, where k makes the largest magnitude
in the bucket over all shards (`all_reduce(MAX)` of one small integer per bucket, the only extra
collective) fit V times below 2**62: no sum can overflow, and every float32 element within 2**-34 of the
bucket's largest keeps all its 24 bits (the rounding of smaller ones is the same on every W as well).
Scaling by a power of two is exact (in float32, or float64 for float64 gradients; half types are scaled in
float32), the rounding to integers is a pure function of each value, and the conversion back rounds an
exact integer once.

Non-finite gradients. An inf or NaN in any shard (a float16 overflow that a GradScaler is about to skip)
has no fixed-point form: the MAX carries a flag, and every rank's gradients become NaN, so the scaler
skips the step on every rank alike.

Pure functions, one small class, and `exact_mean`, the collectives gradsync.py runs after the last shard.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from ...errors import ConfigError

INT_BITS = 62  # |sum over V shards| < 2**62: room for the sign and for the all-reduce's own adds
NONFINITE = 1 << 20  # an exponent no finite float reaches (float64's is at most 1024): the flag in the MAX
ZERO = -149  # the exponent of a bucket of zeros: below every nonzero float32's (the smallest is 2**-149)
ONE_FACTOR = 120  # a power of two beyond this is applied as two factors, each inside float32's range


def shard_range(shards: int, world: int, rank: int) -> range:
    """The virtual shards rank `rank` of `world` holds: contiguous, the first `shards % world` ranks one more."""
    if not 1 <= world <= shards or not 0 <= rank < world:
        raise ValueError(f"{shards} virtual shards cannot be held by rank {rank} of {world}")
    base, extra = divmod(shards, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def exponent(grads: list[torch.Tensor]) -> int:
    """The smallest e with |g| < 2**e for every element of these gradients (one bucket, this rank's shards);
    NONFINITE if one of them is inf or NaN."""
    top = max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)
    if not math.isfinite(top):
        return NONFINITE
    return math.frexp(top)[1] if top else ZERO


def scale_bits(exp: int, shards: int) -> int:
    """k such that V values below 2**exp, each scaled by 2**k and rounded, add up below 2**INT_BITS."""
    return INT_BITS - exp - max(1, math.ceil(math.log2(shards)))


def _times_power_of_two(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x * 2**bits in x's dtype: exact (but where the result leaves the normal range), one pass per factor."""
    if abs(bits) <= ONE_FACTOR:
        return x * 2.0 ** bits
    half = bits // 2
    return (x * 2.0 ** half).mul_(2.0 ** (bits - half))


def _wide(dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    """x in float32, or in float64 for float64 gradients: a float16's range would overflow at 2**62."""
    return x.to(torch.float64 if dtype == torch.float64 else torch.float32)


def to_fixed(grad: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """round(grad * 2**bits) as int64, added into `out` when given (exact: integers). In the gradient's own float
    dtype: scaled below 2**62, a float32 is an integer already once it is past 2**24, and rounds exactly below."""
    q = _times_power_of_two(_wide(grad.dtype, grad), bits).round_().to(torch.int64)
    return q if out is None else out.add_(q)


def from_fixed(total: torch.Tensor, bits: int, shards: int, out: torch.Tensor) -> None:
    """out = (total / 2**bits) / shards, in out's dtype: the mean over the V shards (the integer rounded once to
    out's dtype, then scaled exactly, then divided)."""
    out.copy_(_times_power_of_two(_wide(out.dtype, total), -bits).div_(shards))


class ShardGrads:
    """This rank's shards' gradients for one step, bucket by bucket, as each shard's backward left them."""

    def __init__(self, shards: int, here: range):
        self.shards, self.here = shards, here
        self.kept: list[list[torch.Tensor]] = []  # per shard done: a copy of each bucket's gradients

    @property
    def done(self) -> int:
        return len(self.kept)

    def keep(self, grads: list[torch.Tensor], last: bool) -> None:
        """A shard's backward ended; the last shard's gradients are used in place (no copy)."""
        self.kept.append(grads if last else [g.clone() for g in grads])

    def exponents(self) -> list[int]:
        return [exponent([shard[b] for shard in self.kept]) for b in range(len(self.kept[0]))]

    def fixed(self, b: int, bits: int) -> torch.Tensor:
        """Bucket b's gradients over this rank's shards, in fixed point (int64), summed in shard order."""
        total = to_fixed(self.kept[0][b], bits)
        for shard in self.kept[1:]:
            to_fixed(shard[b], bits, total)
        return total

    def clear(self) -> None:
        self.kept = []

    def unfinished(self) -> ConfigError:
        """The optimizer steps before this rank ran a backward for each of its shards."""
        return ConfigError(
            f"under --virtual-shards {self.shards} this rank holds shards {self.here.start}..{self.here.stop - 1} and "
            f"runs one forward and backward for each before optimizer.step(), but it ran {self.done}: split the "
            "step's batch with `for x, y in trainguard.micro_batches(x, y):`")


def exact_mean(ex: ShardGrads, grads: list[torch.Tensor], group, launch_more: Callable[[], list]) -> None:
    """After the rank's last shard's backward: every shard's gradients, bucket by bucket, added in fixed point over
    the ranks, and their mean over the V shards written into `grads` (the last shard's own). `launch_more()`
    launches what else travels with the exchange and returns its works."""
    exps = torch.tensor(ex.exponents(), dtype=torch.int64)
    dist.all_reduce(exps, op=dist.ReduceOp.MAX, group=group)
    nonfinite = bool((exps >= NONFINITE).any())
    bits = [scale_bits(int(e), ex.shards) for e in exps]
    totals = [] if nonfinite else [ex.fixed(b, k) for b, k in enumerate(bits)]
    works = [dist.all_reduce(t, group=group, async_op=True) for t in totals] + launch_more()
    for work in works:
        work.wait()
    for grad, total, k in zip(grads, totals, bits):
        from_fixed(total, k, ex.shards, grad)
    if nonfinite:
        for grad in grads:
            grad.fill_(float("nan"))
