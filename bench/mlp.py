"""One worker of bench/overhead.py: an MLP on synthetic data, SGD with momentum, gloo on CPU.

    torchrun --standalone --nproc-per-node 2 bench/mlp.py --params 5m --steps 20
    trainguard run --workers 2 bench/mlp.py --params 5m --steps 20 --trainguard

Without --trainguard it is plain torch: init_process_group("gloo"), DistributedDataParallel,
torch's DistributedSampler and DataLoader. With it, the same lines use trainguard's drop-in
wrappers; nothing else differs. Each rank times every step (from fetching its batch to the end of
optimizer.step()). Rank 0 prints `median step time: X ms (N steps after W warm-up)`; every rank
prints `peak rss: rank R X MB`, and the minor page faults of the timed steps per step (memory
the allocator gave back to the kernel and took again: each costs a trap and a zeroed page).
"""

import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

# hidden width of three hidden layers: 64 -> H -> H -> H -> 10 has about 1M, 5M or 18M parameters
WIDTHS = {"1m": 690, "5m": 1570, "18m": 3000}
IN, OUT = 64, 10

parser = argparse.ArgumentParser()
parser.add_argument("--params", choices=sorted(WIDTHS), default="1m")
parser.add_argument("--steps", type=int, default=20, help="timed steps, after the warm-up")
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=32, help="per rank")
parser.add_argument("--trainguard", action="store_true", help="use trainguard's wrappers instead of torch's")
args = parser.parse_args()
torch.set_num_threads(1)

# --- cluster ------------------------------------------------------------------------------
if args.trainguard:
    import trainguard as tg

    tg.init()
else:
    dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

# --- data: exactly one epoch of warm-up + timed steps on every rank ---------------------------
total = args.warmup + args.steps
samples = total * args.batch_size * world
gen = torch.Generator().manual_seed(0)
dataset = TensorDataset(torch.randn(samples, IN, generator=gen), torch.randint(0, OUT, (samples,), generator=gen))

# --- model ------------------------------------------------------------------------------------
torch.manual_seed(0)
width = WIDTHS[args.params]
net = nn.Sequential(nn.Linear(IN, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                    nn.Linear(width, width), nn.ReLU(), nn.Linear(width, OUT))
if args.trainguard:
    model = tg.DDP(net)
    optimizer = tg.Optimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    sampler = tg.DistributedSampler(dataset, shuffle=True, seed=0)
    loader = tg.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    first_epoch = tg.start_epoch(0)
else:
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    first_epoch = 0

# --- train, timing every step -------------------------------------------------------------------
times = []
faults_at = None
for epoch in range(first_epoch, 1):
    sampler.set_epoch(epoch)
    t = time.perf_counter()
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        now = time.perf_counter()
        times.append(now - t)
        t = now
        if len(times) == args.warmup:
            faults_at = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

# --- report ---------------------------------------------------------------------------------------
timed = times[args.warmup:]
if rank == 0:
    n_params = sum(p.numel() for p in net.parameters())
    print(f"mlp: {n_params / 1e6:.2f}M parameters, {world} workers, "
          f"{'trainguard' if args.trainguard else 'torch DDP'}", flush=True)
    print(f"median step time: {1000 * statistics.median(timed):.3f} ms "
          f"({len(timed)} steps after {args.warmup} warm-up)", flush=True)
usage = resource.getrusage(resource.RUSAGE_SELF)
faults = (usage.ru_minflt - faults_at) / len(timed) if faults_at is not None and timed else float("nan")
print(f"peak rss: rank {rank} {usage.ru_maxrss / 1024:.1f} MB, {faults:.1f} page faults per step", flush=True)
dist.destroy_process_group()
