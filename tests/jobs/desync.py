"""A small data-parallel trainer with a rank-dependent bug at step 5 (tests/test_desync.py), written as people
write them: every rank but one reduces a flag the others do not.

    op     rank 1 broadcasts the flag while the others all_reduce it (gloo waits until its timeout)
    shape  rank 1 all_reduces a flag of 8 numbers, the others of 4 (gloo aborts a rank at once)
    skip   rank 1 skips the flag's all_reduce and goes on to its next step (gloo aborts a rank at once)
    end    rank 1 stops training after step 5; the others all_reduce the flag at the end
    update rank 1 skips step 5's optimizer.step() after its backward (as on a loss of its own over a limit)

Rank 1 writes when it reached the mismatch to OUT/mismatch_at (the second argument).
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import trainguard as tg
from trainguard import DDP

mode, out = sys.argv[1], sys.argv[2]
tg.init()
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
optimizer = tg.Optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
data = torch.randn(64, 8)

for step in range(tg.start_step(), 12):
    x = data[(step * 8) % 64:(step * 8) % 64 + 8]
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    if not (mode == "update" and rank == 1 and step == 5):  # `if loss.item() > limit: continue`, on one rank
        optimizer.step()
    if step == 5:
        if rank == 1:
            with open(os.path.join(out, "mismatch_at"), "w") as f:
                f.write(repr(time.time()))
        flag = torch.ones(8 if mode == "shape" and rank == 1 else 4)
        if mode == "op" and rank == 1:
            dist.broadcast(flag, 0)
        elif mode == "end" and rank == 1:
            break
        elif not (mode == "skip" and rank == 1):
            dist.all_reduce(flag)
if mode == "end":
    dist.all_reduce(torch.ones(4))
print(f"rank {rank}: done", flush=True)
