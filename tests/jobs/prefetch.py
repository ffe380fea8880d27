"""A data-parallel trainer that overlaps loading with compute, in one of two shapes:

- `--shape during`: the next batch is taken from the loader during the step, between the backward and
  `optimizer.step()`;
- `--shape ahead`: the loader is wrapped in a prefetcher that takes the next batch before it hands out the current
  one (timm's `PrefetchLoader`, apex's `data_prefetcher`; here without CUDA streams);
- `--shape concat`: no prefetch, but each forward takes two batches of the loader, concatenated.

The training set augments in `__getitem__` from torch's global generator (a random shift and noise, as
torchvision's random transforms draw), with no loader workers, and the loop mixes each batch with a rolled copy of
itself by a weight drawn from NumPy's global generator (mixup). A CNN with BatchNorm and dropout, SGD with
momentum, a StepLR per epoch; `--accum 2` takes two micro-batches a step under `no_sync()`. Ported from torchrun
by its imports, `tg.Optimizer` and `tg.start_epoch()`. Run it under `trainguard run` (or `trainguard verify`)."""

import argparse
import contextlib
import os
import sys

import numpy as np
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


class Prefetcher:
    """Takes the next batch before handing out the current one."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        it = iter(self.loader)
        current = next(it, None)
        for upcoming in it:
            yield current
            current = upcoming
        if current is not None:
            yield current


parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--accum", type=int, default=1)
parser.add_argument("--shape", choices=["during", "ahead", "concat"], default="during")
parser.add_argument("--last-loss", action="store_true", help="rank 0 prints the epoch's last loss after the loop, "
                    "as people do (`loss.item()`), an error only rank 0 meets after a resume at an epoch's end")
parser.add_argument("--sum-loss", action="store_true", help="print the epoch's loss summed as run_clm_no_trainer does "
                    "(`total_loss = 0`, `total_loss += loss.detach()`, `total_loss.item()` after the loop)")
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


def mixed(images, labels):
    lam = float(np.random.beta(0.4, 0.4))
    return lam * images + (1 - lam) * images.roll(1, 0), labels, labels.roll(1, 0), lam


def micro_step(batch, sync):
    images, a, b, lam = mixed(*batch)
    with sync:
        out = model(images)
        loss = (lam * F.cross_entropy(out, a) + (1 - lam) * F.cross_entropy(out, b)) / args.accum
        loss.backward()
    return loss


for epoch in range(tg.start_epoch(), args.epochs):
    sampler.set_epoch(epoch)
    model.train()
    losses, total_loss = [], 0
    if args.shape == "during":
        it = iter(loader)
        batch = next(it, None)
        while batch is not None:
            opt.zero_grad()
            for micro in range(args.accum):
                loss = micro_step(batch, model.no_sync() if micro < args.accum - 1 else contextlib.nullcontext())
                batch = next(it, None)  # the next batch, loaded while this step finishes
                if batch is None:
                    break
            opt.step()
            losses.append(loss.item())
            total_loss += loss.detach()
    elif args.shape == "concat":
        it = iter(loader)
        for first in it:
            second = next(it, None)
            if second is not None:
                first = (torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]]))
            opt.zero_grad()
            loss = micro_step(first, contextlib.nullcontext())
            opt.step()
            losses.append(loss.item())
    else:
        for i, batch in enumerate(Prefetcher(loader)):
            last = (i + 1) % args.accum == 0 or i + 1 == len(loader)
            loss = micro_step(batch, contextlib.nullcontext() if last else model.no_sync())
            if last:
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
    sched.step()
    if args.sum_loss:
        print(f"epoch {epoch}: train loss {total_loss.item() / len(loader)}", flush=True)
    if args.last_loss and dist.get_rank() == 0:
        print(f"epoch {epoch}: last loss {loss.item()}", flush=True)
    if dist.get_rank() == 0:
        print(f"epoch {epoch}: {len(losses)} steps", flush=True)
dist.destroy_process_group()
