"""A stream that keeps its own position: the protocol of torchdata's StatefulDataLoader, under trainguard.

A stream (an IterableDataset) has no position to set, so trainguard resumes it by reading its pass again up to the
committed batch (train/data/loaders.py): exact, at the cost of reading every batch the pass has given so far, which
for a pretraining stream hours long is hours. A dataset with `state_dict()` and `load_state_dict()` (the protocol of
torchdata's `StatefulDataLoader`: each loader worker's copy of the dataset says where its own iterator is, and
`load_state_dict` before `iter()` puts it there) resumes from a saved state instead:

- Each batch carries its worker's state as it was right after the batch's samples were drawn: the dataset's
  `state_dict()` and, in a worker process, the worker's global random states (Python's, NumPy's, torch's), so that
  a dataset drawing from them comes back too (`_Collate`, around the loader's collate_fn, in the worker).
- The main process keeps, per worker, the states of the training batches handed to the script since the last
  anchor (`Kept`).
- Every `ANCHOR_EVERY` commits, the ranks exchange those states as of the committed batch, rounded down to a
  multiple of the loader's workers: the *anchors*. Batch b of an iterator is worker b mod W's, counted from the
  iterator's start, so an iterator started at a multiple of W hands each worker its own state back. The anchors
  (`Anchors`, one registered state per such loader) are the same on every rank, so they travel with the committed
  state: to a replacement, into checkpoints, across a rewind.
- A resume loads each worker's anchored state into it (after the script's `worker_init_fn`) and reads and drops the
  batches from the anchor to the committed batch: at most `ANCHOR_EVERY` steps' batches and W-1 more, whatever
  the length of the pass. Without an anchor of this pass (before the first exchange) it reads the pass from its
  start, as for any stream.

An anchor is a state the stream had at a batch before the committed one, so whichever anchor a rank holds, it
resumes exactly, provided the dataset's `state_dict()` holds everything its next samples depend on besides the
global random streams (its offset, its own generators). One that misses something is not exact, and the replay
audit and `trainguard verify` say so. Its values must be what a checkpoint holds (dicts, lists, tuples, tensors,
arrays, numbers, strings, bytes): checked at the first batch, a ConfigError otherwise.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ...checkpoint.blob import pack, unpack
from ...checkpoint.codec import flatten_state
from ...errors import CheckpointError, ConfigError
from ...worker.transfer import all_gather_bytes
from ..engine import guard as guard_mod
from ..engine.callbacks import Callback
from ..state.streams import set_stream_states, stream_states

log = logging.getLogger("trainguard.loaders")

ANCHOR_EVERY = 16  # commits between two exchanges of the anchors


def has_state(dataset) -> bool:
    """The dataset is a stream that follows the StatefulDataLoader protocol."""
    return (isinstance(dataset, IterableDataset) and callable(getattr(dataset, "state_dict", None))
            and callable(getattr(dataset, "load_state_dict", None)))


class Kept:
    """One loader's worker states in its current pass, main process side: as of the last anchor (`states`, at batch
    `at`), and each batch's since (`recent`, in the order the script took them)."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.at = 0
        self.states: dict[int, dict] = {}
        self.recent: list[tuple[int, dict]] = []
        self.checked = False

    def start(self, epoch: int, anchor: dict | None) -> None:
        self.epoch, self.recent = epoch, []
        self.at, self.states = (anchor["at"], dict(anchor["workers"])) if anchor is not None else (0, {})

    def took(self, worker: int, state: dict) -> None:
        if not self.checked:
            try:
                flatten_state(state, copy=False)
            except CheckpointError as exc:
                raise ConfigError(f"the training stream's state_dict() holds what a checkpoint cannot: {exc}. Return "
                                  "plain values (numbers, strings, lists, dicts, tensors, arrays)") from exc
            self.checked = True
        self.recent.append((worker, state))

    def anchor(self, epoch: int, position: int, workers: int) -> dict | None:
        """The workers' states at batch `position` of pass `epoch`, rounded down to a multiple of `workers`; None
        where this rank does not have them (another pass)."""
        aligned = position - position % max(1, workers)
        folded = aligned - self.at
        if epoch != self.epoch or folded < 0 or folded > len(self.recent):
            return None
        for worker, state in self.recent[:folded]:
            self.states[worker] = state
        del self.recent[:folded]
        self.at = aligned
        return {"epoch": epoch, "at": aligned, "workers": dict(self.states)}


class Anchors(Callback):
    """Every rank's anchor for one stateful stream (registered state, and a session callback that exchanges them)."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self.ranks: dict[int, dict] = {}

    def state_dict(self) -> dict:
        return {"ranks": self.ranks}

    def load_state_dict(self, state: dict) -> None:
        ranks = state.get("ranks") if isinstance(state, dict) else None
        if not isinstance(ranks, dict) or not all(_well_formed(r, a) for r, a in ranks.items()):
            raise ConfigError("the saved position of a training stream is malformed: resume from another checkpoint")
        self.ranks = {int(r): a for r, a in ranks.items()}

    def on_step_end(self, session) -> None:
        if session.train_loader != self.loader.tg_index or session.step % ANCHOR_EVERY:
            return
        mine = self.loader.tg_kept.anchor(session.epoch, session.in_epoch, self.loader.num_workers)
        parts = all_gather_bytes(pack(mine), session.rt.group)
        self.ranks = {r: a for r, part in enumerate(parts) if (a := unpack(part, "a peer's stream anchor")) is not None}

    def resume_point(self, rank: int, epoch: int, position: int) -> dict | None:
        anchor = self.ranks.get(rank)
        if anchor is None or anchor["epoch"] != epoch or anchor["at"] > position:
            return None
        return anchor


def _well_formed(rank, anchor) -> bool:
    """An anchor as `Kept.anchor` makes it (pure): what a checkpoint or a peer hands over is checked before use."""
    if not (isinstance(rank, int) or (isinstance(rank, str) and rank.isdigit())) or not isinstance(anchor, dict):
        return False
    workers = anchor.get("workers")
    return (type(anchor.get("epoch")) is int and type(anchor.get("at")) is int and anchor["at"] >= 0
            and isinstance(workers, dict) and all(type(w) is int and isinstance(st, dict) and "dataset" in st
                                                  for w, st in workers.items()))


def attach(loader) -> Kept | None:
    """For a loader over a stateful stream, made before training starts: its `Kept`, with its anchors registered
    with the job's state. None otherwise (a later loader's stream is read again from the start of its pass)."""
    if not has_state(loader.dataset):
        return None
    guard = guard_mod.active()
    if guard is not None and guard.session is not None:
        log.info("loader %d: made after training started, so its stream's state is not kept", loader.tg_index)
        return None
    loader.tg_anchors = Anchors(loader)
    guard_mod.register_state(f"trainguard:stream:{loader.tg_index}", loader.tg_anchors)
    return Kept()


def resume_point(loader, session) -> dict | None:
    """The anchor the training loader's pass resumes from on this rank, if it has one."""
    if getattr(loader, "tg_kept", None) is None:
        return None
    return loader.tg_anchors.resume_point(session.rt.rank, session.epoch, session.in_epoch)


def kept_pass(loader, session, anchor: dict | None):
    """A pass over `loader` (a torch DataLoader over a stateful stream) from `anchor` (None: from the start) whose
    batches' worker states go to `loader.tg_kept` while it may be the training loader. Its iterator, and so its
    workers' base seed, is made now; the batches come as they are taken."""
    workers = (anchor or {}).get("workers", {})
    if loader.num_workers == 0 and 0 in workers:
        loader.dataset.load_state_dict(copy.deepcopy(workers[0]["dataset"]))
    inner = iter(torch.utils.data.DataLoader(
        loader.dataset, batch_size=loader.batch_size, num_workers=loader.num_workers,
        collate_fn=_Collate(loader.collate_fn, loader.dataset), pin_memory=loader.pin_memory,
        drop_last=loader.drop_last, timeout=loader.timeout, worker_init_fn=_Load(loader.worker_init_fn, workers),
        multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
        prefetch_factor=loader.prefetch_factor, persistent_workers=False, pin_memory_device=loader.pin_memory_device))
    kept = loader.tg_kept
    kept.start(session.epoch, anchor)

    def batches():
        for batch, worker, state in inner:
            if session.train_loader in (None, loader.tg_index):  # an eval stream keeps nothing
                kept.took(worker, state)
            yield batch

    return batches()


class _Collate:
    """The loader's collate_fn, then the state of the worker that made the batch (in the worker process)."""

    def __init__(self, collate, dataset) -> None:
        self.collate, self.dataset = collate, dataset

    def __call__(self, samples):
        batch = self.collate(samples)
        info = get_worker_info()
        if info is None:  # the main process: the step's keyed streams cover its random draws
            return batch, 0, {"dataset": copy.deepcopy(self.dataset.state_dict())}
        return batch, info.id, {"dataset": info.dataset.state_dict(), "rng": stream_states()}


class _Load:
    """A worker's `worker_init_fn`: the script's own, then this worker's anchored state, if it has one."""

    def __init__(self, then, workers: dict[int, dict]) -> None:
        self.then, self.workers = then, workers

    def __call__(self, worker_id: int) -> None:
        if self.then is not None:
            self.then(worker_id)
        state = self.workers.get(worker_id)
        if state is not None:
            get_worker_info().dataset.load_state_dict(state["dataset"])
            set_stream_states(state["rng"])
