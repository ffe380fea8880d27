"""A data-parallel trainer (BatchNorm, dropout, an LR schedule) for tests/test_desync.py's stuck ranks.

    python -m trainguard run --workers 3 --hang-timeout 3 tests/jobs/hang.py OUT [stuck | side | side-untracked]

- stuck: rank 1, in its first life only, gets stuck in its own code at step 6 (a `time.sleep` standing in for a
  deadlocked loader or a filesystem that stopped answering) while its peers wait for it in the gradient exchange.
- side: after each step, a side channel of the script's own groups, as people write one for a metric: rank 0
  reduces the loss with rank 2 on a group of the two, then sends the result to rank 1 on another, which rank 1
  waits for. With TG_FAULT killing rank 2, rank 0's reduce fails and it goes back to its commit while rank 1 is
  left waiting on rank 0, which is alive.
- side-untracked: the same, rank 0 and 1's group made past trainguard's hook on torch's group maker, as by a
  library trainguard never sees: its connections are not cut, and only the left-behind watchdog frees rank 1.
"""

import os
import sys
import time

import torch
from torch import nn

import trainguard as tg
from trainguard import DDP

out, mode = sys.argv[1], (sys.argv[2:] or [""])[0]
tg.init()
rank = tg.get_rank()
if mode.startswith("side"):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    with_2 = dist.new_group([0, 2])
    make = c10d._new_group_with_tag.__trainguard_wrapped__ if mode == "side-untracked" else dist.new_group
    with_1 = make([0, 1])
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
optimizer = tg.Optimizer(optimizer, lr_scheduler=scheduler)
data = torch.randn(192, 8, generator=torch.Generator().manual_seed(1))


def stuck_in_user_code():
    time.sleep(600)


for step in range(tg.start_step(), 12):
    if mode == "stuck" and step == 6 and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        stuck_in_user_code()
    x = data[(step * 48 + rank * 16) % 192:][:16]
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    if mode.startswith("side"):
        metric = loss.detach().reshape(1)
        if rank in (0, 2):
            dist.all_reduce(metric, group=with_2)
        if rank == 0:
            dist.send(metric, 1, group=with_1)
        elif rank == 1:
            dist.recv(metric, 0, group=with_1)
os.makedirs(out, exist_ok=True)
torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict()}, os.path.join(out, f"rank_{rank}.pt"))
