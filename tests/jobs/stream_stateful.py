"""
Streaming pretraining on CPU whose dataset keeps its own position, the way torchdata's StatefulDataLoader asks for:
the dataset has state_dict()/load_state_dict(), and each loader worker's copy says where its stream is.

    trainguard run --workers 3 stream_stateful.py --max-steps 60

Each (rank, loader worker) reads its own shard of a character corpus in order, wrapping around, and masks
characters at random with Python's global generator inside the worker (a cheap augmentation).
"""

import argparse
import inspect
import json.decoder
import os
import random
import textwrap

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import IterableDataset, get_worker_info

import trainguard as tg
from trainguard import DDP, DataLoader


class CharShards(IterableDataset):
    def __init__(self, text, block_size, rank, world_size, mask_p=0.1):
        super().__init__()
        chars = sorted(set(text))
        self.stoi = {ch: i for i, ch in enumerate(chars)}
        self.vocab_size = len(chars) + 1  # the last id is the mask
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        self.block_size, self.rank, self.world_size, self.mask_p = block_size, rank, world_size, mask_p
        self.offset = None  # this worker's next window; None: the start of its shard
        self.loaded = False

    def _shard(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        shards = self.world_size * workers
        size = (len(self.data) - self.block_size - 1) // shards
        start = (self.rank * workers + worker) * size
        return start, size

    def __iter__(self):
        start, size = self._shard()
        if self.offset is None:
            self.offset = start
        while True:
            x = self.data[self.offset:self.offset + self.block_size].clone()
            y = self.data[self.offset + self.block_size]
            for i in range(self.block_size):
                if random.random() < self.mask_p:
                    x[i] = self.vocab_size - 1
            self.offset = start + (self.offset - start + 7) % size
            yield x, y

    def state_dict(self):
        return {"offset": self.offset}

    def load_state_dict(self, state):
        self.offset = state["offset"]
        if not self.loaded and self.rank == 0:
            print(f"[rank 0] stream resumes at offset {self.offset}", flush=True)
        self.loaded = True


class Net(nn.Module):
    def __init__(self, vocab_size, block_size, n_embd=16, n_hidden=96):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, n_embd)
        self.body = nn.Sequential(nn.Linear(block_size * n_embd, n_hidden), nn.GELU(), nn.Dropout(0.1),
                                  nn.Linear(n_hidden, vocab_size))

    def forward(self, idx):
        return self.body(self.emb(idx).flatten(1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=12)
    parser.add_argument("--final-out", type=str, default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    tg.init()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    text = "".join(inspect.getsource(m) for m in (textwrap, json.decoder))
    ds = CharShards(text, args.block_size, rank, world_size)
    loader = DataLoader(ds, batch_size=args.batch_size, num_workers=args.num_workers)

    model = DDP(Net(ds.vocab_size, args.block_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.max_steps)
    optimizer = tg.Optimizer(optimizer, lr_scheduler=scheduler)

    it = iter(loader)
    for step in range(tg.start_step(), args.max_steps):
        x, y = next(it)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)

    if args.final_out:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, f"{args.final_out}_rank{rank}.pt")


if __name__ == "__main__":
    main()
