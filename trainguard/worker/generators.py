"""The script's own `torch.Generator`s: known, so that the training side keys them at every commit
(train/state/streams.py: `Streams.own_generators`).

A trainer that draws its batches from a generator of its own (`data_gen = torch.Generator().manual_seed(seed)`,
then `torch.randint(..., generator=data_gen)` at the top of every step: a pipeline's stages must all draw the same
batch, so they cannot use torch's global stream, which dropout moves differently on each) holds a position
trainguard cannot see: after a fault the script runs again from the top, the generator starts over from its seed,
and the replayed steps train on other batches. Saving its state at the commit does not cover it either: the script
draws the next step's batch after the commit and before any call trainguard sees.

So, as for torch's global stream, the position is made a function of the step: every generator the script makes is
re-seeded at every commit, and at a restore, from (the job's seed, the seed the script gave it, the committed step).
The draws of a step (its batch before the forward, a mask in the loss) then come out the same in every run that
reaches that step. Two generators the script seeded alike stay alike (every stage draws the same batch); one seeded
per rank stays its rank's (a replacement's script seeds it the same way).

`install()` replaces `torch.Generator` by `ScriptGenerator`, a subclass that notes the instances made by the
script's own code: a frame in the script's directory, outside any installed package (torch's samplers, a
framework's loaders make their own and are left alone). Everything that takes a generator takes the subclass.
It is installed before the script runs where the worker was forked with torch loaded (`trainguard run`'s zygote and
hot spares), else when the script joins the job (`init_process_group()`, `trainguard.init()`): a generator made
before that is not known.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref

import torch

from .ledger import OURS

_script_dir: str | None = None
_made: "weakref.WeakKeyDictionary[torch.Generator, int | None]" = weakref.WeakKeyDictionary()  # -> the script's
# seed for it, noted the first time it is keyed (None: not yet)
_lock = threading.Lock()
class ScriptGenerator(torch.Generator):
    """`torch.Generator`, noted when the script's own code makes it."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        if _made_by_script(sys._getframe(1)):
            with _lock:
                _made[self] = None


def _made_by_script(frame) -> bool:
    """The code that called `torch.Generator()` is in the script's directory, not in an installed package (torch's
    samplers make theirs from the script's `for batch in loader`: theirs are not the script's)."""
    if frame is None or _script_dir is None:
        return False
    path = os.path.abspath(frame.f_code.co_filename)
    return (path.startswith(_script_dir) and not path.startswith(OURS)
            and "site-packages" not in path and "dist-packages" not in path)


def install(script: str | None = None) -> None:
    """Note the generators made by code in the directory of `script` (default: sys.argv[0]); once per process, and
    not while torch itself is being imported (its docs are attached to `torch.Generator` last: a worker whose script
    imports torch is asked again at `init_process_group()` / `trainguard.init()`)."""
    global _script_dir
    if _script_dir is not None or getattr(getattr(torch, "__spec__", None), "_initializing", False):
        return
    where = script or (sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else "")
    if not where:
        return
    _script_dir = os.path.dirname(os.path.abspath(where)) + os.sep
    torch.Generator = ScriptGenerator


def script_generators() -> list[tuple[torch.Generator, int]]:
    """The script's live generators, each with the seed the script gave it (as it was when first asked)."""
    with _lock:
        out = []
        for g, seed in list(_made.items()):
            if seed is None:
                _made[g] = seed = g.initial_seed()
            out.append((g, seed))
        return out
