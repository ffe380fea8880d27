"""A data-parallel trainer (BatchNorm, dropout, an LR schedule) in which rank 1, in its first life only, gets
stuck in its own code at step 6 (a `time.sleep` standing in for a deadlocked loader or a filesystem that stopped
answering) while its peers wait for it in the gradient exchange (tests/test_desync.py).

    python -m trainguard run --workers 3 --hang-timeout 3 tests/jobs/hang.py OUT [stuck]
"""

import os
import sys
import time

import torch
from torch import nn

import trainguard as tg
from trainguard import DDP

out, stuck = sys.argv[1], sys.argv[2:] == ["stuck"]
tg.init()
rank = tg.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
optimizer = tg.Optimizer(optimizer, lr_scheduler=scheduler)
data = torch.randn(192, 8, generator=torch.Generator().manual_seed(1))


def stuck_in_user_code():
    time.sleep(600)


for step in range(tg.start_step(), 12):
    if stuck and step == 6 and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        stuck_in_user_code()
    x = data[(step * 48 + rank * 16) % 192:][:16]
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
os.makedirs(out, exist_ok=True)
torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict()}, os.path.join(out, f"rank_{rank}.pt"))
