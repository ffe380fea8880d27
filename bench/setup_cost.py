"""A hand-written data-parallel trainer whose setup costs what the flags say, for bench/recovery.py's setup cells.

    trainguard run --workers 3 bench/setup_cost.py [--setup-sleep 5] [--compile]

`--setup-sleep S` sleeps S seconds after `trainguard.init()`, standing in for a big model's build, sharding and
loading; `--compile` compiles the model with `torch.compile` (nanoGPT's default). Everything else is the shape of
examples/trainer.py's loop: digits, a small MLP with BatchNorm and dropout, SGD, `trainguard.DataLoader`.
"""

import argparse
import time

import torch
from sklearn.datasets import load_digits
from torch import nn

import trainguard as tg

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--setup-sleep", type=float, default=0.0)
parser.add_argument("--compile", action="store_true")
args = parser.parse_args()

tg.init()
time.sleep(args.setup_sleep)
torch.manual_seed(0)
images, labels = load_digits(return_X_y=True)
data = torch.utils.data.TensorDataset(torch.tensor(images, dtype=torch.float32) / 16.0, torch.tensor(labels))
loader = tg.DataLoader(data, batch_size=32, sampler=tg.DistributedSampler(data, seed=0), drop_last=True)
net = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10))
if args.compile:  # as nanoGPT: compile, then wrap for data parallelism
    net = torch.compile(net)
model = tg.DDP(net)
optimizer = tg.Optimizer(torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
loss_fn = nn.CrossEntropyLoss()

for epoch in range(tg.start_epoch(), args.epochs):
    loader.sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
