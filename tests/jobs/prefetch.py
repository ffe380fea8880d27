"""A data-parallel trainer that overlaps loading with compute: the next batch is taken from the loader during the
step, between the backward and `optimizer.step()` (as the hand-written prefetchers of ImageNet-style trainers do),
and the training set augments in `__getitem__` from torch's global generator (a random shift and noise, as
torchvision's random transforms draw), with no loader workers. A CNN with BatchNorm and dropout, SGD with
momentum, a StepLR per epoch; `--accum 2` takes two micro-batches a step under `no_sync()`. Ported from torchrun
by its imports, `tg.Optimizer` and `tg.start_epoch()`. Run it under `trainguard run` (or `trainguard verify`)."""

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

import trainguard as tg

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from digits_data import load_digits  # noqa: E402  (scikit-learn's digits, without its 2 s import)


class Augmented(Dataset):
    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        dy, dx = torch.randint(-1, 2, (2,)).tolist()
        image = torch.roll(self.images[i], shifts=(dy, dx), dims=(1, 2))
        return image + 0.05 * torch.randn_like(image), self.labels[i]


parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--accum", type=int, default=1)
args = parser.parse_args()

dist.init_process_group("gloo")
torch.manual_seed(0)
x, y = load_digits(return_X_y=True)
data = Augmented(torch.tensor(x[:576], dtype=torch.float32).view(-1, 1, 8, 8) / 16, torch.tensor(y[:576]))
sampler = tg.DistributedSampler(data, seed=0)
loader = tg.DataLoader(data, batch_size=16, sampler=sampler)  # 12 batches a rank
model = tg.DDP(nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                             nn.Dropout(0.2), nn.Linear(512, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
opt = tg.Optimizer(opt, lr_scheduler=sched)

for epoch in range(tg.start_epoch(), args.epochs):
    sampler.set_epoch(epoch)
    model.train()
    it = iter(loader)
    batch = next(it, None)
    losses = []
    while batch is not None:
        opt.zero_grad()
        for micro in range(args.accum):
            images, labels = batch
            sync = model.no_sync() if micro < args.accum - 1 else contextlib.nullcontext()
            with sync:
                loss = F.cross_entropy(model(images), labels) / args.accum
                loss.backward()
            batch = next(it, None)  # the next batch, loaded while this step finishes
            if batch is None:
                break
        opt.step()
        losses.append(loss.item())
    sched.step()
    if dist.get_rank() == 0:
        print(f"epoch {epoch}: {len(losses)} steps", flush=True)
dist.destroy_process_group()
