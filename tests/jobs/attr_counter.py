"""A trainer whose model keeps a plain Python counter (tests/test_audit.py): a noise scale annealed by the number
of training calls, kept as an attribute, not a buffer, so it is in no state_dict. After a rewind the model is
built again and the counter starts over: the replayed step sees the same batch but computes something else."""

import os
import sys

import torch
from torch import nn

import trainguard as tg
from trainguard import DDP, DataLoader, DistributedSampler


class Annealed(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.calls = 0  # the script's own state: not restored

    def forward(self, x):
        if self.training:
            self.calls += 1
        return self.net(x) * (1.0 + 1.0 / self.calls)


out = sys.argv[1]
tg.init()
torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(480, 8, generator=torch.Generator().manual_seed(1)))
loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, seed=3))
model = DDP(Annealed())
optimizer = tg.Optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
for epoch in range(tg.start_epoch(), 1):
    loader.sampler.set_epoch(epoch)
    for (x,) in loader:
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
os.makedirs(out, exist_ok=True)
torch.save(model.module.state_dict(), os.path.join(out, f"rank_{tg.get_rank()}.pt"))
