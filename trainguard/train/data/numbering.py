"""`enumerate(loader)` over a pass resumed mid-epoch numbers its batches as the run without a fault did.

After a restore the training loader's pass goes on from the committed batch p, but Python's `enumerate` counts
from 0 again: every label the loop computes from it moves by p. timm's `last_batch = batch_idx == len(loader) - 1`
was then never true, so the epoch's last (partial) accumulation was never stepped; torch's documented
`scheduler.step(epoch + i / iters)` (CosineAnnealingWarmRestarts) took other LRs; a `break` at a batch count trained
more batches. Each was exit 0, "lost 0 steps", other weights.

So a worker that makes a trainguard loader replaces the builtin `enumerate` with a subclass that adds p to the
start when it is handed such a pass (`ResumedPass.first`): `enumerate(loader)` and `enumerate(loader, 1)` label the
resumed batches p and p + 1 on, as before the fault. Everything else is the builtin's (the same C iterator, one
Python call more to make one). Not covered: a counter of the script's own (`i += 1`), `zip(range(n), loader)`, and
an `enumerate` over a wrapper that makes the pass later (tqdm's): use `trainguard.start_batch` for those.
"""

from __future__ import annotations

import builtins

_BUILTIN = builtins.enumerate


class ResumedPass:
    """A loader's pass that begins at batch `first` of its epoch (the pass's iterator sets it)."""

    first = 0


class enumerate(_BUILTIN):  # noqa: N801  the builtin's name, as `repr(type(...))` shows it
    """The builtin `enumerate`, counting a resumed pass from where the run without a fault was."""

    __slots__ = ()

    def __new__(cls, iterable, start=0):
        it = iter(iterable)
        if isinstance(it, ResumedPass):
            start += it.first
        return _BUILTIN.__new__(cls, it, start)


def install() -> None:
    """Make `enumerate` in this process the one above (idempotent)."""
    builtins.enumerate = enumerate
