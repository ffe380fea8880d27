"""The gradient sum over V virtual shards (train/parallel/exactsum.py, gradsync.py's set_shards): the same bits
at every world size, on real processes (gloo), where the float sum over ranks gives other bits."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from harness import free_port
from torch import nn

from trainguard.testing.leaving import leave_together
from trainguard.train.parallel.exactsum import cover, fold, shard_range

SHARDS = 12


def test_the_shards_are_split_contiguously_over_any_world():
    for world in range(1, SHARDS + 1):
        held = [shard_range(SHARDS, world, r) for r in range(world)]
        assert [s for r in held for s in r] == list(range(SHARDS))
        assert max(map(len, held)) - min(map(len, held)) <= 1
    with pytest.raises(ValueError):
        shard_range(4, 5, 0)  # more ranks than shards: a rank would hold none


def test_every_world_adds_the_same_tree_and_its_root_has_the_same_bits():
    """Each rank's nodes (`cover`) partition its range; the ranks' nodes together partition the shards, and folding
    them to the root gives the same bits at every world size and is close to the exact mean. A rank sends one node
    where its range is a node of the tree (V = 12 on 1, 2, 4, 12 ranks)."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(1000, generator=gen) * 10.0 ** float(torch.randint(-6, 3, (1,), generator=gen))
             for _ in range(SHARDS)]
    leaves = {range(s, s + 1): g for s, g in enumerate(grads)}
    results = []
    for world in range(1, SHARDS + 1):
        nodes = [cover(shard_range(SHARDS, world, r), SHARDS) for r in range(world)]
        for r, held in enumerate(nodes):
            assert [s for node in held for s in node] == list(shard_range(SHARDS, world, r))
        if world in (1, 2, 4, 12):
            assert all(len(held) == 1 for held in nodes), (world, nodes)
        given = {node: fold(node, leaves) for held in nodes for node in held}  # what each rank adds itself
        results.append(fold(range(SHARDS), given))
    assert all(torch.equal(results[0], r) for r in results[1:])
    want = torch.stack([g.double() for g in grads]).sum(0).float()
    assert torch.allclose(results[0], want, rtol=1e-5, atol=1e-5)
    left_fold = grads[0]
    for g in grads[1:]:
        left_fold = left_fold + g
    assert not torch.equal(left_fold, results[0])  # the order matters in float: the tree fixes it


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 32),
                         nn.ReLU(), nn.Linear(32, 5))


PLAN = ((1, (True,)), (2, (True,)), (3, (True, False)), (4, (True, False)))  # world -> modes (exact or float sum)


def _train(rank: int, world: int, port: int, out: str) -> None:
    """Every PLAN entry in one set of processes: a group of its first w ranks trains once per mode."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    groups = []  # every group lives to the end: one dropped early closes its connections under a peer still in it
    for w, modes in PLAN:
        groups.append(dist.new_group(list(range(w))))  # collective: every rank makes every group
        for exact in modes if rank < w else ():
            _train_once(rank, w, groups[-1], out, exact)
    leave_together(store, rank, world)


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
    result = {"params": [p.detach().clone() for p in model.parameters()],
              "grads": [p.grad.clone() for p in model.parameters()]}
    if exact:  # one more exchange, shard 5's loss overflowed: the inf reaches every rank's gradients, as under DDP
        optimizer.zero_grad()
        for s in here:
            scale = float("inf") if s == 5 else 1.0
            (nn.functional.cross_entropy(model(xs[0, s]), ys[0, s]) * scale).backward()
        sync.result()
        result["finite"] = [bool(torch.isfinite(p.grad).all()) for p in model.parameters()]
    sync.detach()
    torch.save(result, f"{out}/w{world}-{exact}-{rank}.pt")


def trained(tmp_path) -> dict[tuple[int, bool], dict]:
    """Rank 0's result for every (world, exact) of PLAN, from one set of 4 spawned processes (each spawn costs
    seconds of imports)."""
    mp.start_processes(_train, args=(4, free_port(), str(tmp_path)), nprocs=4, start_method="spawn")
    return {(w, exact, r): torch.load(tmp_path / f"w{w}-{exact}-{r}.pt") for w, modes in PLAN for exact in modes
            for r in range(w)}


@pytest.mark.timeout(240)
def test_virtual_shards_train_to_the_same_bits_on_one_two_three_and_four_ranks(tmp_path):
    """4 steps of SGD with momentum, dropout and BatchNorm, 12 shards of 8 samples: every parameter and gradient is
    equal on every rank of 1, 2, 3 and 4 ranks, and a shard's inf reaches every rank's every gradient. The float sum
    over ranks (each rank's shards accumulated, then averaged as DDP
    does) gives other bits at 3 and 4 ranks: the test would see a sum that depends on the world."""
    got = trained(tmp_path)  # groups of the first 1, 2, 3 and 4 ranks of one job
    for w in (1, 2, 3, 4):
        for r in range(w):
            for key in ("params", "grads"):
                assert all(torch.equal(a, b) for a, b in zip(got[1, True, 0][key], got[w, True, r][key])), (w, r, key)
            assert not any(got[w, True, r]["finite"]), (w, r)
    assert not all(torch.equal(a, b) for a, b in zip(got[3, False, 0]["params"], got[4, False, 0]["params"]))
