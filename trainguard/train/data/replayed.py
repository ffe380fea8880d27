"""A framework's own loader as a trainguard loader: resumed by reading its pass again.

A framework's prepared loader (Accelerate's `DataLoaderShard`) shards and shuffles the data itself, and its order
is not a function of a position trainguard could set: each pass draws a permutation from a generator whose state
carries over from pass to pass (synchronised from rank 0), and counts its passes (`iteration`, the key of a
seedable sampler). What makes a pass come out the same is that state as it was when the pass began. So:

- `PassStarts` holds, for each such loader, its state when its current pass began (`begin`), or its state now
  between passes; that is what a commit takes (one object given to `register_state`), and a restore puts it back
  before the loader's next pass begins. The training loader's pass counts as current until its next pass begins:
  a job that comes back to an epoch's end (its eval, its save) reads that epoch's pass again, to its end. A loader
  made after the restore (the script asked for it later, e.g. Accelerate's `skip_first_batches`) takes its state
  when it is made.
- `ReplayedLoader` wraps the framework's loader. It is numbered among trainguard's loaders, and the training loader
  among them resumes as a stream does (train/data/loaders.py): its pass is made again from the restored state and
  read up to the committed batch, which costs the reading of those batches (rank 0 prints how many and how long).
  Any other attribute is the framework loader's.

The framework loader stays what the framework keeps and tracks (its gradient-accumulation state, its metrics
gathering); only the iteration goes through here.
"""

from __future__ import annotations

from typing import Any, Callable

from ..engine import guard as guard_mod
from ..engine import rewind as rewind_mod
from . import loaders
from .plainloaders import Resumable

Capture = Callable[[Any], dict]  # the loader's state now
Apply = Callable[[Any, dict], None]  # set the loader's state


class PassStarts:
    """The state each wrapped loader had when its current pass began (or has now, between passes); one object for
    `register_state`, restored into the loaders that exist and kept for those made later."""

    def __init__(self, capture: Capture, apply: Apply) -> None:
        self.capture, self.apply = capture, apply
        self.loaders: dict[int, Any] = {}  # tg_index -> the framework's loader
        self.started: dict[int, dict] = {}  # tg_index -> its state when its current pass began
        self.pending: dict[int, dict] = {}  # restored for loaders not made yet

    def add(self, index: int, inner) -> None:
        self.loaders[index] = inner
        if index in self.pending:
            self.apply(inner, self.pending.pop(index))

    def begin(self, index: int) -> None:
        self.started[index] = self.capture(self.loaders[index])

    def end(self, index: int) -> None:
        self.started.pop(index, None)

    def state_dict(self) -> dict:
        return {str(i): self.started.get(i) or self.capture(inner) for i, inner in self.loaders.items()}

    def load_state_dict(self, state: dict) -> None:
        self.started.clear()
        self.pending = {int(i): s for i, s in state.items()}
        for index in [i for i in self.pending if i in self.loaders]:
            self.apply(self.loaders[index], self.pending.pop(index))


class ReplayedLoader(Resumable):
    """A framework's loader whose passes trainguard follows; see the module docstring."""

    replays_pass = True  # loaders.replays: resumed by reading the pass again

    def __init__(self, inner, starts: PassStarts, *, defer: bool = False) -> None:
        self.inner = inner
        self.defer = defer  # each pass is decided at its first batch (Lightning makes its iterator before set_epoch)
        self.starts = starts
        self.tg_index = rewind_mod.next_loader_index()
        self.last_replayed = None  # the last batch its pass was read again up to, after a restore
        self.deferred: _Deferred | None = None  # its last pass decided at its first batch
        starts.add(self.tg_index, inner)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str):  # anything else is the framework loader's (batch_size, dataset, set_epoch...)
        if name in ("inner", "starts", "tg_index", "last_replayed", "deferred", "defer"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __iter__(self):
        if self.defer or guard_mod.active() is None:  # or made before the optimizer is wrapped (Lightning sizes its
            self.deferred = _Deferred(self)  # training loader in configure_optimizers): the pass is decided at its
            return self.deferred  # first batch, with the sampler's epoch as it is then
        return loaders.guarded_iter(self)

    def begin_pass(self) -> None:
        """The pass last asked for and not begun yet is made now, not at its first batch (a restored training loader
        reads it again up to the committed batch here)."""
        if self.deferred is not None:
            self.deferred.start()

    def plain_iter(self):
        return self._pass()

    def quiet_iter(self, session, anchor=None):  # a framework's loader keeps no state of its own (no anchor)
        return self._pass()  # a generator: nothing is drawn until its first batch, inside the step's streams

    def _pass(self):
        self.starts.begin(self.tg_index)  # the first next(): before the framework's pass draws its order
        yield from self.inner
        guard = guard_mod.active()
        if guard is None or guard.session is None or guard.session.train_loader != self.tg_index:
            self.starts.end(self.tg_index)  # another loader: its state between passes is its state now
        # the training loader keeps its pass's start until its next pass begins: a job that comes back to the end of
        # this epoch reads the whole pass again, which leaves it as this pass's end left it


class _Deferred:
    """A pass decided at its first batch: `loaders.guarded_iter` then (the guard exists, the sampler's epoch is set)."""

    def __init__(self, loader: ReplayedLoader) -> None:
        self.loader, self.it = loader, None

    def __iter__(self):
        return self

    def start(self) -> None:
        if self.it is None:
            self.it = iter(loaders.guarded_iter(self.loader))

    def __next__(self):
        self.start()
        return next(self.it)
