"""A step-based trainer in the shape of timm's and diffusion repositories' loops: batches come from a generator
that cycles over the epochs (`set_epoch` each pass), 2 micro-batches a step under `no_sync()`. An MLP with
BatchNorm and dropout, AdamW with a warm-up LambdaLR per step, gradient clipping. Two ports:

- `--epoch-from-steps` (4 batches a pass on each rank, 2 steps an epoch): ported with `start_step` alone, the
  generator started at the epoch the script's own step count gives;
- without it (3 batches a pass: one step in two takes the last batch of one pass and the first of the next): the
  generator started at `start_epoch()`.

`--eval after|before`: every 4 steps an eval whose loss is all_reduced and printed by rank 0, in the loop body after
`opt.step()` (where a fault in it is skipped by the run after: the replay audit says so), or at the top of the next
iteration, nanoGPT's place (where it runs again). Run it under `trainguard run` (or `trainguard verify`)."""

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import trainguard as tg

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from digits_data import load_digits  # noqa: E402  (scikit-learn's digits, without its 2 s import)

parser = argparse.ArgumentParser()
parser.add_argument("--max-steps", type=int, default=12)
parser.add_argument("--accum", type=int, default=2)
parser.add_argument("--epoch-from-steps", action="store_true")
parser.add_argument("--eval", choices=["none", "after", "before"], default="none",
                    help="every 4 steps, an all_reduced eval after `opt.step()` or at the top of the next iteration")
parser.add_argument("--out", default="out")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
size = 384 if args.epoch_from_steps else 288  # on 3 ranks: 4 or 3 batches of 32 a rank
x, y = load_digits(return_X_y=True)
data = TensorDataset(torch.tensor(x[:size], dtype=torch.float32) / 16, torch.tensor(y[:size]))
sampler = tg.DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
loader = tg.DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)


def cycle(start_epoch):
    epoch = start_epoch
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


torch.manual_seed(0)
model = tg.DDP(nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10)))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
opt = tg.Optimizer(opt, lr_scheduler=sched)

if args.epoch_from_steps:
    start = tg.start_step(0)
    batches = cycle(start // (len(loader) // args.accum))  # the script's own epoch count, from its steps
else:
    batches = cycle(tg.start_epoch())
    start = tg.start_step(0)


def evaluate(step):
    model.eval()
    with torch.no_grad():
        loss = F.cross_entropy(model(data.tensors[0][:64]), data.tensors[1][:64]).reshape(1)
    dist.all_reduce(loss)
    model.train()
    if rank == 0:
        print(f"eval after step {step}: {loss.item() / world:.8f}", flush=True)


for step in range(start, args.max_steps):
    if args.eval == "before" and step and step % 4 == 0:
        evaluate(step)
    opt.zero_grad(set_to_none=True)
    for micro in range(args.accum):
        xb, yb = next(batches)
        with model.no_sync() if micro < args.accum - 1 else contextlib.nullcontext():
            (F.cross_entropy(model(xb), yb) / args.accum).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    if args.eval == "after" and (step + 1) % 4 == 0:
        evaluate(step + 1)

os.makedirs(args.out, exist_ok=True)
torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()},
           os.path.join(args.out, f"final_rank{rank}.pt"))
dist.destroy_process_group()
