"""The cadence of a sharded job's in-memory copies (train/parallel/buddy.py): as often as keeps them within 3% of
the steps' time, judged on rounds that say what a copy costs. A generation's first round (new group, ranks still
busy with the restore) took 0.26 s against 0.02 s for the next ones, and once spaced the copies 28 steps apart:
a second fault then lost 24 steps."""

from __future__ import annotations

import time

import torch

from trainguard.train.parallel.buddy import BUDGET, MAX_EVERY, Copies, Exchange, propose_every


def test_the_proposal_keeps_the_copies_within_the_budget():
    assert propose_every(0.0, 0.0, 0.1) == 1  # free: every step
    every = propose_every(0.005, 0.020, 0.1)
    assert every == 9 and (0.005 + 0.020) / every <= BUDGET * 0.1 < (0.005 + 0.020) / (every - 1)
    assert propose_every(10.0, 10.0, 0.001) == MAX_EVERY
    assert propose_every(0.005, 0.02, 0.0) == 10  # no step timed yet


def _round(ex: Exchange, step: int) -> None:
    ex.submit(step, {"w": torch.full((4,), float(step))}, {}, None)
    deadline = time.monotonic() + 30
    while ex.busy and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not ex.busy


def test_a_generations_first_round_does_not_set_the_cadence_and_one_slow_round_does_not_either():
    copies = Copies()
    ex = Exchange(copies, None, 0, None, None, None)  # no buddy: the thread packs and keeps its own copies
    try:
        _round(ex, 1)
        assert ex.work_s is None  # the first round is not a measure
        _round(ex, 2)
        first = ex.work_s
        assert first is not None and first < 1.0
        assert copies.held() == {"0": [1, 2]}
        slow = time.monotonic()
        ex.submit(3, {"w": torch.zeros(4)}, {}, _Slow(0.3))  # a round the machine held up
        while ex.busy:
            time.sleep(0.005)
        assert time.monotonic() - slow >= 0.3 and ex.work_s == first  # the least of the recent rounds
    finally:
        assert ex.close()


class _Slow:
    """A `ready` event that completes late."""

    def __init__(self, s: float):
        self.s = s

    def synchronize(self) -> None:
        time.sleep(self.s)
