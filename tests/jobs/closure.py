"""A trainer that steps with a closure, as PyTorch's optimizer docs show it (`optimizer.step(closure)`, the closure
zeroes the gradients, runs the forward and the backward and returns the loss): digits, an MLP with BatchNorm and
dropout, SGD with momentum and a StepLR per epoch, trainguard's loaders. At the end every rank checks that the
data-parallel replicas hold the same parameters (a step whose update did not wait for its gradient exchange would
leave them apart) and saves its state for `trainguard verify`."""

import hashlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import trainguard as tg

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from digits_data import load_digits  # noqa: E402  (scikit-learn's digits, without its 2 s import)

EPOCHS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
tg.init()
torch.manual_seed(0)
x, y = load_digits(return_X_y=True)
data = torch.utils.data.TensorDataset(torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y))
loader = tg.DataLoader(data, batch_size=32, sampler=tg.DistributedSampler(data, seed=0), drop_last=True)
model = tg.DDP(nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10)))
if os.environ.get("CLOSURE_OPTIMIZER") == "lbfgs":  # several evaluations of the closure in one step: refused
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.05)
else:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
optimizer = tg.Optimizer(optimizer, lr_scheduler=scheduler)
loss_fn = nn.CrossEntropyLoss()

for epoch in range(tg.start_epoch(), EPOCHS):
    loader.sampler.set_epoch(epoch)
    model.train()
    for inputs, targets in loader:
        def closure():
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            return loss

        loss = optimizer.step(closure)
    scheduler.step()
    if tg.get_rank() == 0:
        print(f"epoch {epoch}: last loss {loss.item():.6f}", flush=True)

digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
digests = [None] * dist.get_world_size()
dist.all_gather_object(digests, digest)
if len(set(digests)) != 1:
    raise SystemExit(f"data-parallel replicas differ after training: {digests}")
