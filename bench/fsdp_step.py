"""One worker of bench/sharded_overhead.py: an MLP whose layers are each `fully_shard`ed (FSDP2) over
every rank, AdamW, synthetic data, gloo on CPU.

    torchrun --standalone --nproc-per-node 2 bench/fsdp_step.py --params 5m --steps 20
    trainguard run --workers 2 bench/fsdp_step.py --params 5m --steps 20 --trainguard

Without --trainguard it is plain torch: init_process_group("gloo"), a 1-D DeviceMesh, the loop.
With it, the same script ported as a user ports it (the one engine: `trainguard.init()`, trainguard's
`init_device_mesh` and `fully_shard`, `trainguard.Optimizer`, the loop from `trainguard.start_step()`):
live recovery, an in-memory copy of each rank's shard on its buddy at the cadence the ranks vote, and
the stop vote at every commit. Nothing else differs. Each rank times
every step from the start of one to the start of the next, so the job's own work between steps
counts. Rank 0 prints `mean step time: X ms, median Y ms (N steps after W warm-up)`: the mean is the
figure to compare, since the in-memory copies come every few dozen steps and a median would skip them.
Every rank prints `peak rss: rank R X MB` at the end (its ru_maxrss: the in-memory copies it holds count).
"""

import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

WIDTHS = {"1m": 690, "5m": 1570, "18m": 3000}  # 64 -> H -> H -> H -> 10
IN, OUT = 64, 10

parser = argparse.ArgumentParser()
parser.add_argument("--params", choices=sorted(WIDTHS), default="1m")
parser.add_argument("--steps", type=int, default=20, help="timed steps, after the warm-up")
parser.add_argument("--warmup", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=32, help="per rank")
parser.add_argument("--trainguard", action="store_true", help="run the loop on trainguard (the one engine)")
args = parser.parse_args()
torch.set_num_threads(1)
H = WIDTHS[args.params]


def build(mesh, shard=fully_shard):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, H), nn.GELU(), nn.Linear(H, H), nn.GELU(), nn.Linear(H, H), nn.GELU(),
                          nn.Linear(H, OUT))
    for layer in model:
        if isinstance(layer, nn.Linear):
            shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(step * 1009 + rank)
    return torch.randn(args.batch_size, IN, generator=g), torch.randint(OUT, (args.batch_size,), generator=g)


def train_step(model, optimizer, step: int, rank: int) -> None:
    x, y = batch(step, rank)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


total = args.warmup + args.steps + 1
starts: list[float] = []
if args.trainguard:
    import trainguard

    trainguard.init()
    rank, world = trainguard.get_rank(), trainguard.get_world_size()
    model, optimizer = build(trainguard.init_device_mesh("cpu", (world,)), trainguard.fully_shard)
    optimizer = trainguard.Optimizer(optimizer)
    for step in range(trainguard.start_step() + 1, total + 1):
        starts.append(time.perf_counter())
        train_step(model, optimizer, step, rank)
    note = f", an in-memory copy every {optimizer.guard.session.live.every} steps"
else:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build(init_device_mesh("cpu", (world,)))
    for step in range(1, total + 1):
        starts.append(time.perf_counter())
        train_step(model, optimizer, step, rank)
    note = ""
    dist.barrier()
steps = [b - a for a, b in zip(starts, starts[1:])][args.warmup:]
if rank == 0:
    print(f"mean step time: {1000 * statistics.mean(steps):.2f} ms, median {1000 * statistics.median(steps):.2f} ms "
          f"({len(steps)} steps after {args.warmup} warm-up{note})", flush=True)
print(f"peak rss: rank {rank} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} MB", flush=True)
if not args.trainguard:
    dist.destroy_process_group()
