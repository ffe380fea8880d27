"""How long a step waits for an in-memory copy of CUDA state (train/parallel/buddy.py: HostCopy, pinned host
buffers filled on a side stream) against a bare device-to-host copy of the same bytes (`.cpu()` of
each tensor, which the host waits for). Needs a CUDA device; the two alternate, medians and ratio.

    python bench/gpu_snapshot.py [--mib 256] [--runs 20]
"""

import argparse
import statistics
import sys
import time

import torch

from trainguard.train.parallel.buddy import HostCopy

parser = argparse.ArgumentParser()
parser.add_argument("--mib", type=int, default=256, help="size of the state, in 16 tensors")
parser.add_argument("--runs", type=int, default=20)
args = parser.parse_args()
if not torch.cuda.is_available():
    sys.exit("bench/gpu_snapshot.py needs a CUDA device")
n = args.mib * (1 << 20) // 4 // 16
tensors = {f"t{i}": torch.randn(n, device="cuda") for i in range(16)}
host = HostCopy()
host.take(tensors)[1].synchronize()  # the pinned buffers are allocated once, at the first snapshot
bare, snap, done = [], [], []
for i in range(args.runs):
    for which in ((0, 1) if i % 2 == 0 else (1, 0)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if which == 0:
            _ = {k: t.cpu() for k, t in tensors.items()}
            bare.append(time.perf_counter() - t0)
        else:
            _, ready = host.take(tensors)
            snap.append(time.perf_counter() - t0)  # what the step waits for
            ready.synchronize()
            done.append(time.perf_counter() - t0)  # when the copy is whole (overlapped with compute in a job)
            host.fence()
mb = 16 * n * 4 / 2**20
print(f"{mb:.0f} MiB of CUDA tensors, median of {args.runs} each, alternating")
print(f"bare device-to-host copy (.cpu()): {1000 * statistics.median(bare):.2f} ms (host blocked throughout)")
print(f"snapshot (pinned, side stream):   {1000 * statistics.median(snap):.3f} ms blocking, whole after "
      f"{1000 * statistics.median(done):.2f} ms")
print(f"blocking ratio snapshot / bare: {statistics.median(snap) / statistics.median(bare):.4f}")
