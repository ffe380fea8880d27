"""One GPU: the resilient group's pieces over NCCL, with figures.

    python bench/gpu_group.py                       # CUDA + NCCL (exits 0 with a message without CUDA)
    python bench/gpu_group.py --device cpu --backend gloo   # the same path on the CPU, as a dry run

1. The typed collectives (worker/collectives.py) over an NCCL group built eagerly with `device_id`:
   the median time of a 100 MB all_reduce with and without the wrapper, alternating.
2. A generation ends: the communicator is aborted (`_abort_process_group`, what a survivor's heartbeat
   thread does when the scheduler moves on) and destroyed, and the next generation's group is built
   under a fresh store prefix: how long the abort and the re-creation take, and that the new group works.
3. The step's buffers on the device (train/state/buffers.py): BatchNorm statistics a skipped step moved go
   back (`rollback`, checked with torch.equal), what a commit's copy costs for 20 BatchNorm layers
   (16,064 channels), and that sharing them through the group (BufferShare) keeps them bit for bit.

Two NCCL ranks cannot share one GPU, so the kill -9 of a peer is tested on gloo (tests/); here one rank
stands for the survivor.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d as c10d

from trainguard.worker import collectives
from trainguard.train.state.buffers import BufferGuard, BufferShare, module_buffers

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda")
parser.add_argument("--backend", default="nccl")
parser.add_argument("--runs", type=int, default=7)
args = parser.parse_args()
if args.device == "cuda" and not torch.cuda.is_available():
    print("no CUDA device: nothing to measure (run with --device cpu --backend gloo for a dry run)")
    raise SystemExit(0)
device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device(args.device)
sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
store = dist.HashStore()
generation = [1]


def build(gen: int) -> float:
    t0 = time.perf_counter()
    kwargs = {"device_id": device} if args.backend == "nccl" else {}
    dist.init_process_group(args.backend, store=dist.PrefixStore(f"trainguard/g{gen}", store), rank=0, world_size=1,
                            timeout=timedelta(seconds=60), **kwargs)
    dist.all_reduce(torch.ones(1, device=device))
    sync()
    return time.perf_counter() - t0


def timed_all_reduce(fn, t: torch.Tensor) -> float:
    sync()
    t0 = time.perf_counter()
    fn(t)
    sync()
    return time.perf_counter() - t0


# --- 1. typed collectives ------------------------------------------------------------------
print(f"torch {torch.__version__}, {args.backend} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
first = build(1)
plain = dist.all_reduce
collectives.install(lambda: generation[0])
wrapped = dist.all_reduce
big = torch.ones(25_000_000, device=device)  # 100 MB of float32
for _ in range(2):
    timed_all_reduce(plain, big), timed_all_reduce(wrapped, big)
pairs = [(timed_all_reduce(plain, big), timed_all_reduce(wrapped, big)) for _ in range(args.runs)]
p, w = statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)
print(f"100 MB all_reduce (one rank: the call's own cost): plain {1000 * p:.3f} ms, typed {1000 * w:.3f} ms (median of {args.runs}, alternating); "
      f"ratio {w / p:.3f}")

# --- 2. a generation ends: abort, re-create ------------------------------------------------
aborts, destroys, rebuilds = [], [], []
for gen in range(2, 2 + args.runs):
    t0 = time.perf_counter()
    if args.backend == "nccl":
        c10d._abort_process_group()  # aborts and forgets every communicator of the process
    t1 = time.perf_counter()
    if dist.is_initialized():
        dist.destroy_process_group()
    aborts.append(t1 - t0)
    destroys.append(time.perf_counter() - t1)
    generation[0] = gen
    rebuilds.append(build(gen))
    t = torch.full((4,), 2.0, device=device)
    dist.all_reduce(t)
    assert torch.equal(t.cpu(), torch.full((4,), 2.0)), t
print(f"first group: {1000 * first:.1f} ms; abort: median {1000 * statistics.median(aborts):.2f} ms "
      f"(max {1000 * max(aborts):.1f}), destroy after it: {1000 * statistics.median(destroys):.2f} ms; "
      f"next generation's group built and used: median {1000 * statistics.median(rebuilds):.1f} ms "
      f"(max {1000 * max(rebuilds):.1f}) over {args.runs} generations")
failed = collectives.failures
failed.record(generation[0], collectives.CollectiveFailed("injected"))
t0 = time.perf_counter()
try:
    dist.all_reduce(big)
    print("a collective of a failed generation ran: WRONG")
except collectives.CollectiveFailed:
    print(f"a collective of a failed generation raised CollectiveFailed in {1e6 * (time.perf_counter() - t0):.1f} us")
generation[0] += 1  # a new generation starts clean

# --- 3. the step's buffers on the device ---------------------------------------------------
net = nn.Sequential(*[nn.BatchNorm1d(c) for c in [64, 256, 256, 256, 128, 512, 512, 512, 512, 256, 1024, 1024,
                                                 1024, 1024, 1024, 1024, 512, 2048, 2048, 2048] * 1]).to(device)
bufs = module_buffers(net)
channels = sum(b.numel() for b in bufs if b.dim() == 1) // 2
guard = BufferGuard(bufs)
x = torch.randn(32, 64, device=device)
with torch.no_grad():
    net[0](x)
guard.commit()
before = [b.clone() for b in bufs]
with torch.no_grad():
    net[0](x * 3)
moved = not torch.equal(net[0].running_mean, before[0])
guard.rollback()
ok = all(torch.equal(a, b) for a, b in zip(bufs, before))
print(f"rollback after a skipped step's forward: moved={moved}, restored bit for bit={ok}")
commits = []
for _ in range(max(20, args.runs)):
    sync()
    t0 = time.perf_counter()
    guard.commit()
    sync()
    commits.append(time.perf_counter() - t0)
print(f"commit copy of {len(bufs)} buffers ({channels} BatchNorm channels): median {1e6 * statistics.median(commits):.1f} us")
share = BufferShare(bufs)
works = share.launch(0, dist.group.WORLD)
for work in works:
    work.wait()
share.finish()
print(f"buffers shared through the group ({len(share.groups)} flat tensors): equal={all(torch.equal(a, b) for a, b in zip(bufs, before))}")
dist.destroy_process_group()
