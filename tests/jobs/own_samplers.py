"""A trainer whose training loader has a sampler of its own, written as speech, NLP and vision repos write them, ported
from the docs by changing only the imports (trainguard's DataLoader):
- `--sampler bucket`: a length-bucketing batch sampler (VITS' DistributedBucketSampler, a subclass of torch's
  DistributedSampler) handed to `batch_sampler=`: variable-length sequences grouped by length, batches shuffled with
  a generator seeded from the epoch, padded by a collate_fn;
- `--sampler ra`: torchvision's RASampler in small (`sampler=`): each index repeated 3 times, shuffled with a
  generator seeded from the epoch, then a permutation from torch's global stream, as a sampler that does not seed
  itself draws;
- `--sampler torch`: torch's own DistributedSampler, left as it was.
Before, each was refused at the first step (exit 78). The dataset draws a random mask in `__getitem__` (in loader
workers with `--workers 2`), the model has dropout, the LR follows a StepLR; the epochs count from 1.

--out FILE: rank 0 saves the model, the optimizer and the scheduler.
"""

import argparse
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

import trainguard as tg
from trainguard import DDP, DataLoader


class Sequences(Dataset):
    def __init__(self, n=300, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(4, 24, (n,), generator=g).tolist()
        self.tokens = [torch.randint(1, 50, (n_,), generator=g) for n_ in self.lengths]

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        x = self.tokens[i]
        keep = torch.rand(len(x)) > 0.1  # a token dropped at random, an augmentation
        x = torch.where(keep, x, torch.zeros_like(x))
        return x, int(self.tokens[i].sum() % 3)


def collate(batch):
    xs, ys = zip(*batch)
    return nn.utils.rnn.pad_sequence(xs, batch_first=True), torch.tensor(ys)


class DistributedBucketSampler(torch.utils.data.DistributedSampler):
    """VITS' sampler in small: indices bucketed by length, batches of one bucket, shuffled by epoch."""

    def __init__(self, dataset, batch_size, boundaries, num_replicas=None, rank=None, shuffle=True):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle)
        self.lengths, self.batch_size = dataset.lengths, batch_size
        self.buckets = [[i for i, n in enumerate(self.lengths) if lo <= n < hi]
                        for lo, hi in zip(boundaries[:-1], boundaries[1:])]
        per = self.num_replicas * batch_size
        self.buckets = [b + b[:(per - len(b) % per) % per] for b in self.buckets if b]
        self.total = sum(len(b) for b in self.buckets)

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.epoch)
        batches = []
        for bucket in self.buckets:
            order = torch.randperm(len(bucket), generator=g).tolist() if self.shuffle else range(len(bucket))
            mine = [bucket[j] for j in order][self.rank::self.num_replicas]
            batches += [mine[k:k + self.batch_size] for k in range(0, len(mine), self.batch_size)]
        if self.shuffle:
            batches = [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]
        return iter(batches)

    def __len__(self):
        return self.total // (self.num_replicas * self.batch_size)


class RASampler(torch.utils.data.Sampler):
    """torchvision's RASampler in small: each index 3 times, this rank's share; then shuffled from the global
    stream, as a sampler that does not seed itself does."""

    def __init__(self, dataset, repetitions=3):
        self.n, self.reps = len(dataset), repetitions
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.per = int(math.floor(self.n // 16 * 16 / self.world))
        self.epoch = 0

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.epoch)
        indices = [i for i in torch.randperm(self.n, generator=g).tolist() for _ in range(self.reps)]
        mine = indices[self.rank:self.n * self.reps:self.world][:self.per]
        return iter([mine[j] for j in torch.randperm(len(mine)).tolist()])

    def __len__(self):
        return self.per

    def set_epoch(self, epoch):
        self.epoch = epoch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sampler", choices=["bucket", "ra", "torch"], default="bucket")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    ds = Sequences()
    if args.sampler == "bucket":
        sampler = DistributedBucketSampler(ds, 8, [4, 10, 16, 24])
        loader = DataLoader(ds, batch_sampler=sampler, collate_fn=collate, num_workers=args.workers)
    else:
        sampler = RASampler(ds) if args.sampler == "ra" else torch.utils.data.DistributedSampler(ds, seed=3)
        loader = DataLoader(ds, batch_size=8, sampler=sampler, collate_fn=collate, num_workers=args.workers,
                            drop_last=True)

    model = DDP(nn.Sequential(nn.EmbeddingBag(50, 24), nn.Dropout(0.2), nn.Linear(24, 3)))
    optimizer = tg.Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)

    for epoch in range(tg.start_epoch(1), args.epochs + 1):
        loader.sampler.set_epoch(epoch) if args.sampler != "bucket" else sampler.set_epoch(epoch)
        model.train()
        for step, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 0 and step % 5 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
        scheduler.step()

    if rank == 0 and args.out:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
