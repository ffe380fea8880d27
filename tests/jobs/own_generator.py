"""A trainer whose batches come from state of its own (tests/test_verify.py, tests/test_audit.py).

OWN_DRAW=iterator (the default): an iterator over a shuffled order made at the start, `next()` at every step.
trainguard cannot see its position: after a rewind the script runs again from the top, the iterator starts over,
and the replayed step trains on another batch (the replay audit says so). OWN_SEED=urandom seeds the shuffle from
the OS: no two runs of the script make the same steps.

OWN_DRAW=generator: a random batch drawn at every step from a `torch.Generator` of the script's own, as pipeline
trainers draw theirs. trainguard keys the script's generators at every commit (worker/generators.py), so a
replayed step draws the batch it drew the first time: exact.
"""

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
pick = torch.Generator().manual_seed(seed)  # the script's own
order = iter(torch.randperm(512 * 10, generator=pick).remainder(512).view(-1, 16))  # a position trainguard cannot see
by_generator = os.environ.get("OWN_DRAW") == "generator"
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
optimizer = tg.Optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
for step in range(tg.start_step(), 10):
    x = data[torch.randint(0, 512, (16,), generator=pick) if by_generator else next(order)]
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
os.makedirs(out, exist_ok=True)
torch.save(model.module.state_dict(), os.path.join(out, f"rank_{tg.get_rank()}.pt"))
