"""The fixed bucket layout (pure): the same for the same model, closed at the caps as DDP's."""

from torch import nn

from trainguard.train.parallel.gradsync import MB, plan_buckets


def layout(model, cap=25 * MB, first=1 * MB):
    return [[tuple(p.shape) for p in b.params] for b in plan_buckets(list(model.parameters()), cap, first)]


def mlp(width):
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def test_reverse_order_and_a_big_gradient_closes_its_bucket():
    # 1570 x 1570 floats are 9.9 MB: the first bucket closes with the first of them, the second at the end
    assert layout(mlp(1570)) == [[(10,), (10, 1570), (1570,), (1570, 1570)],
                                 [(1570,), (1570, 1570), (1570,), (1570, 64)]]


def test_the_layout_is_a_function_of_the_parameters_only():
    assert layout(mlp(690)) == layout(mlp(690))
    assert len(layout(mlp(3000))) == 3  # 36 MB gradients: each closes a bucket past the 25 MB cap


def test_dtypes_never_share_a_bucket():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double())
    assert [len(b) for b in layout(model)] == [2, 2]


# --- the exchange itself, on 3 real processes (gloo) ---------------------------------------------------


def _exchange(rank: int, world: int, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from trainguard.train.parallel.gradsync import GradSync

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = mlp(40)
    sync = GradSync(model, bucket_cap_mb=0.004, first_bucket_mb=0.001)  # several buckets
    sync.attach(dist.group.WORLD)
    torch.manual_seed(1 + rank)
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    loss_fn = nn.CrossEntropyLoss()
    results = {}
    for mode in ("none", "zeros", "accumulate"):
        for p in model.parameters():
            p.grad = None if mode == "none" else (torch.zeros_like(p) if p.grad is None else p.grad.zero_())
        if mode == "accumulate":  # two halves, the first without exchange: the sum of both is exchanged
            with sync.no_sync():
                loss_fn(model(x[:4]), y[:4]).backward()
            (loss_fn(model(x[4:]), y[4:])).backward()
        else:
            (2 * loss_fn(model(x), y)).backward()  # the same gradient as the two halves' sum
        sync.result()
        results[mode] = [p.grad.clone() for p in model.parameters()]
        views = {v.data_ptr() for b in sync.buckets for v in b.views}
        results[mode + "_is_view"] = all(p.grad.data_ptr() in views for p in model.parameters())
    # this rank's own gradient, exchanged by hand, for the expected mean
    for p in model.parameters():
        p.grad = None
    sync.enabled = False
    (2 * loss_fn(model(x), y)).backward()
    own = [p.grad.clone() for p in model.parameters()]
    for g in own:
        dist.all_reduce(g)
    results["expected"] = [g / world for g in own]
    results["experts"] = _experts(rank, world)
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.barrier()  # no rank leaves while a peer's last exchange may still be talking to it (gloo aborts at exit)
    dist.destroy_process_group()


def _experts(rank: int, world: int) -> dict:
    """A trunk and three experts; ranks 0 and 2 route their batch to expert 0, rank 1 to expert 1, nobody to 2."""
    import torch
    import torch.distributed as dist

    from trainguard.train.parallel.gradsync import GradSync

    torch.manual_seed(0)
    trunk, experts = nn.Linear(4, 4), nn.ModuleList(nn.Linear(4, 2) for _ in range(3))
    model = nn.ModuleDict({"trunk": trunk, "experts": experts})
    sync = GradSync(model)
    sync.attach(dist.group.WORLD)
    torch.manual_seed(1 + rank)
    x = torch.randn(8, 4)
    experts[rank % 2](trunk(x)).sum().backward()
    sync.result()
    got = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    sync.enabled = False
    experts[rank % 2](trunk(x)).sum().backward()
    own = {name: torch.zeros_like(p) if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    for g in own.values():
        dist.all_reduce(g)
    sync.close()
    return {"got": got, "expected": {k: v / world for k, v in own.items()}}


def test_three_ranks_get_the_mean_in_views_of_the_buckets(tmp_path):
    """Whether the grads were set to None, zeroed in place (autograd then accumulates into the bucket), or
    accumulated over no_sync: every rank gets the same mean, and each grad is a view of its bucket."""
    import torch
    import torch.multiprocessing as mp

    world = 3
    mp.start_processes(_exchange, args=(world, f"file://{tmp_path}/store", str(tmp_path)), nprocs=world,
                       start_method="spawn")
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for r in range(world):
        assert got[r]["none_is_view"] and got[r]["zeros_is_view"] and got[r]["accumulate_is_view"]
        for mode in ("none", "zeros", "accumulate"):
            for a, b, e in zip(got[r][mode], got[0]["none"], got[r]["expected"]):
                assert torch.allclose(a, e, atol=1e-6)  # the mean
                if mode != "accumulate":  # the same sums in the same layout: the same bits on every rank
                    assert torch.equal(a, b)
        # an expert this rank did not use gets the mean where another rank used it (it kept None, and the replicas
        # parted: a blind mixture-of-experts port); one nobody used keeps None, as torch's DDP with
        # find_unused_parameters leaves it
        experts = got[r]["experts"]
        for name, grad in experts["got"].items():
            if name.startswith("experts.2."):
                assert grad is None, name
            else:
                assert grad is not None and torch.allclose(grad, experts["expected"][name], atol=1e-6), name
                assert torch.equal(grad, got[0]["experts"]["got"][name]), name


# --- what rides in the exchange: rank 0's buffers and every rank's numbers, on 3 real processes (gloo) -----------


def _riders(rank: int, world: int, init: str, out: str, dtype_names: tuple[str, ...]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    for dtype_name in dtype_names:  # one set of processes for every dtype (each spawn costs seconds of imports)
        _ride_once(rank, out, dtype_name)
    dist.barrier()  # no rank leaves while a peer's last exchange may still be talking to it (gloo aborts at exit)
    dist.destroy_process_group()


def _ride_once(rank: int, out: str, dtype_name: str) -> None:
    import torch
    import torch.distributed as dist

    from trainguard.train.parallel.gradsync import GradSync
    from trainguard.train.parallel.riders import RankRows
    from trainguard.train.state.buffers import BufferShare

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)).to(dtype)
    half = torch.tensor([1.5, -0.0, 65504.0], dtype=torch.float16)  # a buffer of another dtype
    model.register_buffer("extra", half)
    buffers = [model[1].running_mean, model[1].running_var, model[1].num_batches_tracked, model.extra]
    sync = GradSync(model)
    sync.share = BufferShare(buffers)
    rows = RankRows(6)
    sync.attach(dist.group.WORLD)
    sync.ride(rows)  # after the attach: the tail is laid out again
    torch.manual_seed(1 + rank)
    with torch.no_grad():  # every rank's buffers differ; rank 0's win
        for b in buffers:
            b.copy_((torch.randn(b.shape) * 1e4).to(b.dtype) if b.is_floating_point() else torch.tensor(2 ** 40 + rank))
    mine = torch.tensor([rank, -1.0 / 3, float("inf"), -0.0, 2.0 ** 60 + rank, 1e-310], dtype=torch.float64)
    rows.send(mine)
    model(torch.randn(4, 6, dtype=dtype)).sum().backward()
    sync.result()
    torch.save({"riding": (sync.share.riding, rows.riding), "rows": rows.rows, "mine": mine,
                "buffers": [b.clone() for b in buffers], "grads": [p.grad.clone() for p in model.parameters()]},
               f"{out}/rank{rank}-{dtype_name}.pt")
    sync.detach()
    sync.close()
    dist.barrier()


def test_buffers_and_rank_rows_ride_in_the_last_bucket_bit_for_bit(tmp_path):
    """Rank 0's buffers (float32, an int64 counter past 2**24, float16 with -0.0 and its largest value) reach every rank
    bit for bit, and every rank's float64 numbers (infinities, a subnormal, integers past 2**53) reach every rank in
    its row, riding in a float32 bucket and in a float64 one; in a bfloat16 bucket nothing rides (the share goes on
    its own, the rows are left to their owner) and the buffers still arrive."""
    import torch
    import torch.multiprocessing as mp

    world = 3
    dtypes = ("float32", "float64", "bfloat16")
    mp.start_processes(_riders, args=(world, f"file://{tmp_path}/store", str(tmp_path), dtypes), nprocs=world,
                       start_method="spawn")
    for dtype in dtypes:
        got = [torch.load(tmp_path / f"rank{r}-{dtype}.pt") for r in range(world)]
        rides = dtype != "bfloat16"
        for r in range(world):
            assert got[r]["riding"] == (rides, rides)
            for mine, zero in zip(got[r]["buffers"], got[0]["buffers"]):
                assert mine.dtype == zero.dtype
                assert torch.equal(mine.reshape(-1).view(torch.uint8), zero.reshape(-1).view(torch.uint8))
            for a, b in zip(got[r]["grads"], got[0]["grads"]):
                assert torch.equal(a, b)
            if rides:
                expected = torch.stack([got[k]["mine"] for k in range(world)])
                assert torch.equal(got[r]["rows"].view(torch.int64), expected.view(torch.int64))
            else:
                assert got[r]["rows"] is None
        assert got[0]["buffers"][2].item() == 2 ** 40 + 1  # rank 0's, counted once more by the forward
