"""
Streaming, pretraining-style DDP trainer on CPU (gloo), launched with torchrun.

    torchrun --nproc_per_node 3 stream_torchrun.py --max-steps 60

Each rank (and each DataLoader worker inside it) reads its own endless stream of
next-character prediction windows cut at random offsets from some stdlib source text.
Training is counted in steps, not epochs; rank 0 writes a checkpoint every
--save-every steps and the run resumes from it if it is there.
"""

import argparse
import inspect
import json.decoder
import math
import os
import random
import textwrap

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


def get_text():
    # plain python source from a few stdlib modules, no downloads
    return "".join(inspect.getsource(m) for m in (textwrap, json.decoder, random))


class TokenStream(IterableDataset):
    """Endless stream of (x, y) windows; different for every rank and every worker."""

    def __init__(self, text, block_size, seed, rank, world_size):
        super().__init__()
        chars = sorted(set(text))
        self.stoi = {ch: i for i, ch in enumerate(chars)}
        self.vocab_size = len(chars)
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        self.block_size = block_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size

    def __iter__(self):
        worker_info = get_worker_info()
        worker_id = worker_info.id if worker_info is not None else 0
        num_workers = worker_info.num_workers if worker_info is not None else 1
        # one independent stream per (seed, rank, worker)
        stream_id = self.rank * num_workers + worker_id
        rng = random.Random(f"{self.seed}-{self.rank}-{worker_id}")
        print(f"[rank {self.rank}] worker {worker_id}/{num_workers} -> stream {stream_id} of "
              f"{self.world_size * num_workers}")
        while True:
            i = rng.randrange(0, len(self.data) - self.block_size - 1)
            x = self.data[i:i + self.block_size]
            y = self.data[i + self.block_size]
            yield x, y


class MLP(nn.Module):
    def __init__(self, vocab_size, block_size, n_embd=16, n_hidden=128, dropout=0.1):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.net = nn.Sequential(
            nn.Linear(block_size * n_embd, n_hidden),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(n_hidden, n_hidden),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(n_hidden, vocab_size),
        )

    def forward(self, idx):
        return self.net(self.tok_emb(idx).flatten(1))


def main():
    torch.manual_seed(0)
    parser = argparse.ArgumentParser(description="streaming DDP pretraining on CPU")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument("--ckpt", type=str, default="stream_ckpt.pt")
    parser.add_argument("--seed", type=int, default=1234)
    # --- for the tests ---
    parser.add_argument("--final-out", type=str, default=None,
                        help="every rank saves its final state to {PREFIX}_rank{rank}.pt")
    args = parser.parse_args()

    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    world_size = dist.get_world_size()

    ds = TokenStream(get_text(), args.block_size, args.seed, rank, world_size)
    loader = DataLoader(ds, batch_size=args.batch_size, num_workers=args.num_workers)

    model = MLP(ds.vocab_size, args.block_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)

    def lr_lambda(step):
        # linear warmup then cosine decay to 10%
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    start_step = 0
    if os.path.exists(args.ckpt):
        ckpt = torch.load(args.ckpt, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_step = ckpt["step"]
        if rank == 0:
            print(f"Resuming from {args.ckpt} at step {start_step}")

    model = DDP(model)
    model.train()

    it = iter(loader)
    for step in range(start_step, args.max_steps):
        x, y = next(it)
        logits = model(x)
        loss = F.cross_entropy(logits, y)

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()

        if rank == 0 and step % 10 == 0:
            print(f"step {step:4d} | loss {loss.item():.4f} | lr {scheduler.get_last_lr()[0]:.5f}")

        if rank == 0 and (step + 1) % args.save_every == 0:
            torch.save({
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "step": step + 1,
            }, args.ckpt)
            print(f"saved checkpoint at step {step + 1} to {args.ckpt}")

    # --- for the tests ---
    if args.final_out:
        torch.save({
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        }, f"{args.final_out}_rank{rank}.pt")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
