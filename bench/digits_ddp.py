"""The digits CNN of examples/digits.py under plain torchrun + DistributedDataParallel: the baseline.

    torchrun --nproc-per-node 2 bench/digits_ddp.py --epochs 6
Prints `step time: X ms (median of N)` over the steps after the first 10 (warm-up).
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.05)
args = parser.parse_args()

# --- cluster ---------------------------------------------------------------------
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)

# --- data, as in examples/digits.py --------------------------------------------------
digits = load_digits()
images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
labels = torch.tensor(digits.target, dtype=torch.int64)
order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(42))
n_train = int(0.8 * len(labels))
train_set = TensorDataset(images[order[:n_train]], labels[order[:n_train]])
sampler = DistributedSampler(train_set, seed=0, drop_last=True)
loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)

# --- model -----------------------------------------------------------------------------
net = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
    nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Dropout(0.1), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
)
model = DistributedDataParallel(net)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()

# --- train, timing every step --------------------------------------------------------------
times = []
t = time.perf_counter()
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
        now = time.perf_counter()
        times.append(now - t)
        t = now
window = times[10:]
print(f"step time: {1000 * statistics.median(window):.2f} ms (median of {len(window)}, whole run)", flush=True)
dist.destroy_process_group()
