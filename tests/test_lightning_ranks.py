"""Every rank's part of Lightning's bookkeeping (trainguard/compat/lightning_ranks.py), with 3 real processes on gloo:
a part that fits its vector arrives as numbers in its layout, one whose layout differs between ranks, that outgrows the
vector or whose integers a float64 cannot hold arrives whole, and each rank's part is the one it had when it was sent,
even where its tensors (the live ones, not copied) changed before the gather finished."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")
pytestmark = pytest.mark.timeout(120)

WORLD = 3


def part_of(rank: int, case: str) -> dict:
    import torch

    part = {"results": [{"key": "train_loss", "value": torch.tensor(rank + 0.25), "n": torch.tensor([rank, 7])}],
            "flag": torch.tensor(rank == 1), "output": {"loss": torch.tensor([1.5, -0.0], dtype=torch.float64)}}
    if case == "layouts differ" and rank == 1:
        part["extra"] = torch.tensor([3.0])
    if case == "too big":
        part["big"] = torch.arange(100, dtype=torch.float32) + rank
    if case == "not exact":
        part["results"][0]["n"] = torch.tensor([2 ** 60 + rank, 1])
    return part


CASES = ("fits", "layouts differ", "too big", "too big again", "not exact")


def _parts(rank: int, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from trainguard.compat.lightning_ranks import RankParts, rank_part

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    parts = RankParts()  # no model: the vector goes in an all-gather of its own
    got = {}
    for case in CASES:
        part = part_of(rank, case.removesuffix(" again"))
        parts.start(part)
        part["results"][0]["value"].add_(100.0)  # a value logged again before the update: the part sent is as it was
        gathered = parts.finish()
        got[case] = {"how": "packed" if "packed" in gathered else "numbers", "capacity": parts.capacity,
                     "parts": [rank_part(gathered, r) for r in range(WORLD)]}
    torch.save(got, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_every_rank_gets_every_ranks_part_as_it_was_sent(tmp_path):
    import torch
    import torch.multiprocessing as mp

    mp.start_processes(_parts, args=(f"file://{tmp_path}/store", str(tmp_path)), nprocs=WORLD, start_method="spawn")
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    expected_how = {"fits": "numbers", "layouts differ": "packed", "too big": "packed", "too big again": "numbers",
                    "not exact": "packed"}
    for case in CASES:
        sent = [part_of(r, case.removesuffix(" again")) for r in range(WORLD)]
        for r in range(WORLD):
            assert got[r][case]["how"] == expected_how[case], (case, r)
            for k in range(WORLD):
                assert same(got[r][case]["parts"][k], sent[k]), (case, r, k, got[r][case]["parts"][k], sent[k])
    assert [got[0][c]["capacity"] for c in CASES] == [64, 64, 128, 128, 128]  # grown once, the same on every rank
