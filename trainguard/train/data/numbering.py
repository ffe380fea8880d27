"""`enumerate(loader)` over a pass resumed mid-epoch numbers its batches as the run without a fault did.

After a restore the training loader's pass goes on from the committed batch p, but Python's `enumerate` counts
from 0 again: every label the loop computes from it moves by p. timm's `last_batch = batch_idx == len(loader) - 1`
was then never true, so the epoch's last (partial) accumulation was never stepped; torch's documented
`scheduler.step(epoch + i / iters)` (CosineAnnealingWarmRestarts) took other LRs; a `break` at a batch count trained
more batches. Each was exit 0, "lost 0 steps", other weights.

So a worker that makes a trainguard loader replaces the builtin `enumerate` with a subclass that adds p to the
start when it is handed such a pass (`ResumedPass.first`): `enumerate(loader)` and `enumerate(loader, 1)` label the
resumed batches p and p + 1 on, as before the fault. Everything else is the builtin's (the same C iterator, one
Python call more to make one).

A wrapper that makes the pass later, when it is first asked for an item, is a generator: torchvision's
`enumerate(metric_logger.log_every(loader, ...))` (its EMA updated at `i % model_ema_steps == 0` took other batches
after a resume: exit 0, other EMA bits), `enumerate(tqdm(loader))`. An `enumerate` over a generator adds, from its
first item on, the `first` of a training pass that began while that item was made (`ResumedPass.begun`): one Python
call more an item, and only where a pass began. Not covered: a counter of the script's own (`i += 1`),
`zip(range(n), loader)`, a wrapper that yields other than one item a batch: use `trainguard.start_batch` for those.
"""

from __future__ import annotations

import builtins
import types

_BUILTIN = builtins.enumerate
_begun = [0, 0]  # training passes begun in this process, and the `first` of the last one


class ResumedPass:
    """A loader's pass that begins at batch `first` of its epoch (the pass's iterator sets it, then calls `begun`)."""

    first = 0

    def begun(self) -> None:
        _begun[0] += 1
        _begun[1] = self.first


class enumerate(_BUILTIN):  # noqa: N801  the builtin's name, as `repr(type(...))` shows it
    """The builtin `enumerate`, counting a resumed pass from where the run without a fault was."""

    __slots__ = ()

    def __new__(cls, iterable, start=0):
        it = iter(iterable)
        if isinstance(it, ResumedPass):
            start += it.first
        elif isinstance(it, types.GeneratorType):
            return _OverWrapper(it, start)
        return _BUILTIN.__new__(cls, it, start)


class _OverWrapper(enumerate):
    """`enumerate` over a generator: shifted by the `first` of a training pass its first item began."""

    __slots__ = ("shift", "asked")

    def __new__(cls, it, start):
        self = _BUILTIN.__new__(cls, it, start)
        self.shift, self.asked = 0, False
        return self

    def __next__(self):
        if not self.asked:
            self.asked = True
            before = _begun[0]
            i, item = _BUILTIN.__next__(self)
            if _begun[0] != before:
                self.shift = _begun[1]
            return i + self.shift, item
        if not self.shift:
            return _BUILTIN.__next__(self)
        i, item = _BUILTIN.__next__(self)
        return i + self.shift, item


def install() -> None:
    """Make `enumerate` in this process the one above (idempotent)."""
    builtins.enumerate = enumerate
