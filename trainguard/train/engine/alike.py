"""A registered object must hold the same values on every rank: the job keeps one copy of it.

`register_state` objects (and the ones trainguard finds unregistered) are part of the committed state, which every
holder keeps alike and a replacement takes from a peer. An object whose values differ between ranks loses the
dead rank's values at the first fault, and the run goes on from a peer's: exit 0, other bits. The common case is an
EMA copied from the model before `DDP(...)` gave every rank rank 0's weights (timm's `ModelEmaV2` is made there,
after a seed of `seed + rank`). At a fresh start the ranks compare a sampled digest of each such object, once (one
all-gather of a few bytes each), and rank 0 names the first that differs and the fix. Trainguard's and the framework
integrations' own objects are left out: they hold per-rank parts by design (the transformers Trainer's loss sums
gathered from every rank, each loader's start).
"""

from __future__ import annotations

import json
import logging

from ...errors import ConfigError
from ...worker.transfer import all_gather_bytes
from .probe import digest

log = logging.getLogger("trainguard.session")

OWN = ("trainguard:", "lightning:", "accelerate:loaders", "accelerate:saves")  # per-rank parts, handled


def unlike(by_rank: list[dict[str, str]]) -> dict[str, list[int]]:
    """{name: the ranks whose digest differs from rank 0's}, for each object that differs anywhere (pure)."""
    return {name: bad for name in by_rank[0]
            if (bad := [r for r, d in enumerate(by_rank) if d.get(name) != by_rank[0][name]])}


def message(name: str, ranks: list[int]) -> str:
    where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return (f"the registered object {name!r} holds other values on {where} than on rank 0 at the job's start. "
            "trainguard keeps one copy of it for the job, the same on every rank: after a fault a replacement takes "
            "a peer's, and the run is no longer the one without a fault. An EMA copied from the model before "
            "DDP(...) wraps it holds each rank's own initial weights (timm makes its ModelEmaV2 there, after seeding "
            "with seed + rank): make it after DDP(...), which gives every rank rank 0's weights as torch's does, or "
            "make the object's values the same on every rank")


def not_everywhere(by_rank: list[dict[str, str]]) -> str | None:
    """What is wrong where some ranks registered an object others did not (pure), else None."""
    names = sorted(set().union(*by_rank))
    missing = {name: [r for r, d in enumerate(by_rank) if name not in d] for name in names}
    missing = {name: ranks for name, ranks in missing.items() if ranks}
    if not missing:
        return None
    name, ranks = next(iter(missing.items()))
    return (f"the object {name!r} is registered (register_state, or found on the optimizer) on some ranks and not on "
            f"rank(s) {ranks}: every rank holds the job's state, the same objects alike, and a replacement takes a "
            "peer's. Make and register it on every rank (an EMA kept on rank 0 alone: keep it, and update it, on every "
            "rank; only its saving needs `if rank == 0`)")


def check(extra: dict, group) -> list[str]:
    """At a fresh start, on every rank together (one all-gather, with or without objects: a rank that registered one
    must not make a collective the others do not): the messages for the registered objects that differ between ranks
    (rank 0 logs them); a ConfigError where some ranks registered an object others did not."""
    mine = {name: digest(obj.state_dict(), sampled=True) for name, obj in sorted(extra.items()) if not name.startswith(OWN)}
    gathered = [json.loads(b) for b in all_gather_bytes(json.dumps(mine).encode(), group)]
    if (wrong := not_everywhere(gathered)) is not None:
        raise ConfigError(wrong)
    return [message(name, ranks) for name, ranks in unlike(gathered).items()]
