"""A stream that keeps its own position (train/data/streamstate.py), in one process: which worker states an anchor
holds, what a malformed state gets, and that a pass started from an anchor, two loader workers drawing from
Python's global generator in them, gives the batches the first pass gave after that point.

The job-level checks (kill -9 in a step and SIGTERM with a rerun, 3 ranks, every tensor compared) are in
tests/test_ported_trainers.py (tests/jobs/stream_stateful.py under `trainguard verify`).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

from trainguard.errors import ConfigError
from trainguard.train.data import streamstate


def test_an_anchor_holds_each_workers_state_of_its_last_batch_before_a_multiple_of_the_workers():
    kept = streamstate.Kept()
    kept.start(epoch=0, anchor=None)
    for b in range(7):  # batch b is worker b % 2's
        kept.took(b % 2, {"dataset": {"batch": b}})
    anchor = kept.anchor(epoch=0, position=5, workers=2)  # 5 batches taken: rounded down to 4
    assert anchor == {"epoch": 0, "at": 4, "workers": {0: {"dataset": {"batch": 2}}, 1: {"dataset": {"batch": 3}}}}
    assert [s["dataset"]["batch"] for _, s in kept.recent] == [4, 5, 6]  # kept for the next anchor
    assert kept.anchor(epoch=1, position=6, workers=2) is None  # another pass
    assert kept.anchor(epoch=0, position=20, workers=2) is None  # batches this rank never took
    assert kept.anchor(epoch=0, position=7, workers=0)["workers"][0] == {"dataset": {"batch": 6}}  # no workers


def test_a_state_a_checkpoint_cannot_hold_is_a_config_error_at_the_first_batch():
    kept = streamstate.Kept()
    kept.start(epoch=0, anchor=None)
    with pytest.raises(ConfigError, match="state_dict\\(\\) holds what a checkpoint cannot"):
        kept.took(0, {"dataset": {"seen": {1, 2}}})


def test_malformed_anchors_are_refused_naming_the_fix():
    anchors = streamstate.Anchors(loader=None)
    for bad in ({"ranks": {0: {"at": 3}}}, {"ranks": [1]}, "x", {"ranks": {0: {"epoch": 0, "at": "3", "workers": {}}}},
                {"ranks": {0: {"epoch": 0, "at": 3, "workers": {0: {"rng": 1}}}}}):
        with pytest.raises(ConfigError, match="resume from another checkpoint"):
            anchors.load_state_dict(bad)
    anchors.load_state_dict({"ranks": {"1": {"epoch": 2, "at": 8, "workers": {}}}})
    assert anchors.resume_point(1, 2, 9)["at"] == 8
    assert anchors.resume_point(1, 3, 9) is None and anchors.resume_point(1, 2, 7) is None
    assert anchors.resume_point(0, 2, 9) is None


class Noisy(IterableDataset):
    """Each worker counts up from its own start and adds noise from Python's global generator."""

    def __init__(self):
        self.i = None

    def __iter__(self):
        info = get_worker_info()
        if self.i is None:
            self.i = 1000 * info.id
        while True:
            self.i += 1
            yield torch.tensor([float(self.i), random.random()])

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]


def test_a_pass_from_an_anchor_continues_the_first_pass_exactly():
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(Noisy(), batch_size=3, num_workers=2)
    loader.tg_index, loader.tg_kept = 0, streamstate.Kept()
    session = SimpleNamespace(epoch=0, train_loader=None)
    first = streamstate.kept_pass(loader, session, None)
    seen = [next(first) for _ in range(9)]
    anchor = loader.tg_kept.anchor(0, 7, loader.num_workers)  # rounded down to batch 6
    assert anchor["at"] == 6 and set(anchor["workers"]) == {0, 1}
    again = streamstate.kept_pass(loader, session, anchor)
    assert all(torch.equal(a, next(again)) for a in seen[6:])  # values and noise
    del first, again
