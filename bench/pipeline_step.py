"""One worker of bench/pipeline.py: an MLP split into 2 pipeline stages (torch.distributed.pipelining,
PipelineStage + ScheduleGPipe or Schedule1F1B, 4 micro-batches), AdamW, synthetic data, gloo on CPU.

    torchrun --standalone --nproc-per-node 2 bench/pipeline_step.py --steps 60
    trainguard run --workers 2 bench/pipeline_step.py --steps 60 --trainguard

Without --trainguard it is plain torch. With it, the same script ported as a user ports it (`trainguard.init()`,
trainguard's `PipelineStage`, `trainguard.Optimizer`, the loop from `trainguard.start_step()`): live recovery,
in-memory copies of each stage on its buddy at the cadence the ranks vote, the commit vote. Each rank times every
step from the start of one to the start of the next; rank 0 prints `mean step time: X ms, median Y ms (N steps
after W warm-up)`.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=512)
parser.add_argument("--layers", type=int, default=4, help="per stage")
parser.add_argument("--steps", type=int, default=60, help="timed steps, after the warm-up")
parser.add_argument("--warmup", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
parser.add_argument("--trainguard", action="store_true")
args = parser.parse_args()
torch.set_num_threads(1)

if args.trainguard:
    import trainguard
    from trainguard import PipelineStage

    trainguard.init()
else:
    from torch.distributed.pipelining import PipelineStage

    dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(rank)
layers = [m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width), nn.GELU())]
stage_mod = nn.Sequential(*layers, *([nn.Linear(args.width, 10)] if rank == world - 1 else []))
stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))
Schedule = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
schedule = Schedule(stage, 4, loss_fn=lambda out, y: F.cross_entropy(out, y))
optimizer = torch.optim.AdamW(stage_mod.parameters(), lr=1e-3)
start = 0
if args.trainguard:
    optimizer = trainguard.Optimizer(optimizer)
    start = trainguard.start_step()
total = args.warmup + args.steps + 1
starts: list[float] = []
for step in range(start, total):
    starts.append(time.perf_counter())
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(args.batch_size, args.width, generator=g), torch.randint(10, (args.batch_size,), generator=g)
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
steps = [b - a for a, b in zip(starts, starts[1:])][args.warmup:]
if rank == 0 and len(steps) > 1:
    print(f"mean step time: {1000 * statistics.mean(steps):.2f} ms, median {1000 * statistics.median(steps):.2f} ms "
          f"({len(steps)} steps after {args.warmup} warm-up)", flush=True)
if not args.trainguard:
    dist.barrier()
    dist.destroy_process_group()
