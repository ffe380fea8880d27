"""The gradient sum over V virtual shards (train/parallel/exactsum.py, gradsync.py's set_shards): the same bits
at every world size, on real processes (gloo), where the float sum over ranks gives other bits."""

from __future__ import annotations

import random

import pytest
import torch
import torch.multiprocessing as mp
from harness import free_port
from torch import nn

from trainguard.train.parallel.exactsum import from_fixed, scale_bits, shard_range, to_fixed

SHARDS = 12


def test_the_shards_are_split_contiguously_over_any_world():
    for world in range(1, SHARDS + 1):
        held = [shard_range(SHARDS, world, r) for r in range(world)]
        assert [s for r in held for s in r] == list(range(SHARDS))
        assert max(map(len, held)) - min(map(len, held)) <= 1
    with pytest.raises(ValueError):
        shard_range(4, 5, 0)  # more ranks than shards: a rank would hold none


def test_a_fixed_point_sum_has_the_same_bits_in_any_grouping_and_is_close_to_the_exact_mean():
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(1000, generator=gen) * 10.0 ** float(torch.randint(-6, 3, (1,), generator=gen))
             for _ in range(SHARDS)]
    exp = max(torch.frexp(g.abs().max()).exponent.item() for g in grads)
    bits = scale_bits(exp, SHARDS)
    results = []
    for world in (1, 2, 3, 5, 12):
        parts = [sum(to_fixed(grads[s], bits) for s in shard_range(SHARDS, world, r)) for r in range(world)]
        random.Random(world).shuffle(parts)  # the ranks' sums in any order
        out = torch.empty(1000)
        from_fixed(sum(parts), bits, SHARDS, out)
        results.append(out)
    assert all(torch.equal(results[0], r) for r in results[1:])
    want = (torch.stack([g.double() for g in grads]).sum(0) / SHARDS).float()
    assert torch.allclose(results[0], want, rtol=1e-6, atol=0)


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 32),
                         nn.ReLU(), nn.Linear(32, 5))


PLAN = ((1, (True,)), (2, (True,)), (3, (True, False)), (4, (True, False)))  # world -> modes (exact or float sum)


def _train(rank: int, world: int, port: int, out: str) -> None:
    """Every PLAN entry in one set of processes: a group of its first w ranks trains once per mode."""
    import time

    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    groups = []  # every group lives to the end: one dropped early closes its connections under a peer still in it
    for w, modes in PLAN:
        groups.append(dist.new_group(list(range(w))))  # collective: every rank makes every group
        for exact in modes if rank < w else ():
            _train_once(rank, w, groups[-1], out, exact)
    # nobody closes its gloo connections while a peer may still be in the last collective (gloo aborts a process
    # whose peer closed mid-operation): leave through the store, the server (rank 0) last
    store.add("done", 1)
    while int(store.add("done", 0)) < world:
        time.sleep(0.01)
    store.add("gone", 1)
    while rank == 0 and int(store.add("gone", 0)) < world:
        time.sleep(0.01)


def _train_once(rank: int, world: int, group, out: str, exact: bool) -> None:
    from trainguard.train.parallel.gradsync import GradSync

    torch.manual_seed(0)
    model = net()
    sync = GradSync(model, bucket_cap_mb=0.004, first_bucket_mb=0.001)  # several buckets
    if exact:
        sync.set_shards(SHARDS)
    sync.attach(group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(4, SHARDS, 8, 16, generator=data), torch.randint(0, 5, (4, SHARDS, 8), generator=data)
    here = shard_range(SHARDS, world, rank)
    for step in range(4):
        optimizer.zero_grad()
        for i, s in enumerate(here):
            torch.manual_seed(1000 * step + s)  # the shard's dropout, wherever it runs
            loss = nn.functional.cross_entropy(model(xs[step, s]), ys[step, s])
            if exact or i == len(here) - 1:
                loss.backward()
            else:
                with sync.no_sync():
                    loss.backward()
        sync.result()
        optimizer.step()
    sync.detach()
    if rank == 0:
        torch.save({"params": [p.detach().clone() for p in model.parameters()],
                    "grads": [p.grad.clone() for p in model.parameters()]}, f"{out}/w{world}-{exact}.pt")


def trained(tmp_path) -> dict[tuple[int, bool], dict]:
    """Rank 0's result for every (world, exact) of PLAN, from one set of 4 spawned processes (each spawn costs
    seconds of imports)."""
    mp.start_processes(_train, args=(4, free_port(), str(tmp_path)), nprocs=4, start_method="spawn")
    return {(w, exact): torch.load(tmp_path / f"w{w}-{exact}.pt") for w, modes in PLAN for exact in modes}


@pytest.mark.timeout(240)
def test_virtual_shards_train_to_the_same_bits_on_one_two_three_and_four_ranks(tmp_path):
    """4 steps of SGD with momentum, dropout and BatchNorm, 12 shards of 8 samples: every parameter and gradient is
    equal on 1, 2, 3 and 4 ranks. The float sum over ranks (each rank's shards accumulated, then averaged as DDP
    does) gives other bits at 3 and 4 ranks: the test would see a sum that depends on the world."""
    got = trained(tmp_path)  # groups of the first 1, 2, 3 and 4 ranks of one job
    for w in (2, 3, 4):
        for key in ("params", "grads"):
            assert all(torch.equal(a, b) for a, b in zip(got[1, True][key], got[w, True][key])), (w, key)
    assert not all(torch.equal(a, b) for a, b in zip(got[3, False]["params"], got[4, False]["params"]))
