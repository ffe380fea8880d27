"""A trainer that draws its random batches from a generator of its own (tests/test_audit.py): trainguard keys
torch's global generator at every step, but not this one. After a rewind the script runs again from the top,
the generator starts over, and the replayed step trains on another batch. OWN_SEED=urandom seeds it from the OS: no
two runs of the script make the same steps."""

import os
import sys

import torch
from torch import nn

import trainguard as tg
from trainguard import DDP

out = sys.argv[1]
tg.init()
torch.manual_seed(0)
data = torch.randn(512, 8, generator=torch.Generator().manual_seed(1))
seed = int.from_bytes(os.urandom(4), "little") if os.environ.get("OWN_SEED") == "urandom" else 1234
pick = torch.Generator().manual_seed(seed)  # the script's own: not restored (from urandom: no two runs alike)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
optimizer = tg.Optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
for step in range(tg.start_step(), 10):
    x = data[torch.randint(0, 512, (16,), generator=pick)]
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
os.makedirs(out, exist_ok=True)
torch.save(model.module.state_dict(), os.path.join(out, f"rank_{tg.get_rank()}.pt"))
