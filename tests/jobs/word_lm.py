"""pytorch/examples' word_language_model in small, the shape a blind helper ported from the docs: the corpus is one
token tensor, `batchify` cuts it into columns, each rank takes its slice, and the loop slices bptt-long batches by
index (no DataLoader); the GRU's hidden state is carried from batch to batch (`repackage_hidden`) and reset at each
epoch's start; SGD with clipping.

Two ports, both from the docs:
- `--loop epochs`: `for epoch in range(tg.start_epoch(1), ...)`. No trainguard.DataLoader gives the batches, so the
  job cannot know its epoch: after a kill it started again at epoch 1 (240 steps instead of 144, exit 0, "lost 0
  steps"). Now the first step ends the job, exit 78, naming the fix (train/engine/guard.py: NO_EPOCHS).
- `--loop steps`: the fix it names (`start_step`, the epoch and the batches to skip from it). Exact but for the
  hidden state, which the committed state does not hold: the job says so at its second step (train/engine/audit.py:
  "carried").
- `--loop loader`: the other fix it names: the bptt chunks as a dataset, each item already a batch, so
  `tg.DataLoader(..., batch_size=None)` (which failed with a TypeError at the second epoch), the epochs from
  `start_epoch()`, the hidden state started afresh at each batch: exact.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import trainguard as tg
from trainguard import DDP

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from digits_data import load_digits  # noqa: E402  (scikit-learn's digits, without its 2 s import)

BPTT, BATCH, VOCAB = 16, 4, 17


class GRULM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.rnn = nn.GRU(16, 32)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(32, VOCAB)

    def forward(self, x, hidden):
        y, hidden = self.rnn(self.drop(self.emb(x)), hidden)
        return self.out(self.drop(y)), hidden


def batchify(data, bsz):
    n = data.size(0) // bsz
    return data[:n * bsz].view(bsz, -1).t().contiguous()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--loop", choices=("epochs", "steps", "loader"), default="steps")
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    tokens = torch.tensor(load_digits(return_X_y=True)[0][:150].reshape(-1), dtype=torch.long)
    share = tokens.size(0) // world
    train = batchify(tokens[rank * share:(rank + 1) * share], BATCH)
    steps_per_epoch = (train.size(0) - 1) // BPTT
    model = DDP(GRULM())
    optimizer = tg.Optimizer(torch.optim.SGD(model.parameters(), lr=0.5))

    def run_epoch(epoch, skip):
        hidden = torch.zeros(1, BATCH, 32)
        for batch, i in enumerate(range(0, steps_per_epoch * BPTT, BPTT)):
            if batch < skip:
                continue
            x, y = train[i:i + BPTT], train[i + 1:i + 1 + BPTT]
            hidden = hidden.detach()  # repackage_hidden
            out, hidden = model(x, hidden)
            loss = F.cross_entropy(out.view(-1, VOCAB), y.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch} done", flush=True)

    if args.loop == "loader":
        chunks = [(train[i:i + BPTT], train[i + 1:i + 1 + BPTT]) for i in range(0, 6 * BPTT, BPTT)]  # 6 a pass
        sampler = tg.DistributedSampler(chunks, num_replicas=1, rank=0, shuffle=True, seed=0)  # every rank's own slice
        loader = tg.DataLoader(chunks, batch_size=None, sampler=sampler)
        for epoch in range(tg.start_epoch(0), args.epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                out, _ = model(x, torch.zeros(1, BATCH, 32))
                loss = F.cross_entropy(out.view(-1, VOCAB), y.reshape(-1))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            if rank == 0:
                print(f"epoch {epoch} done", flush=True)
    elif args.loop == "epochs":
        for epoch in range(tg.start_epoch(1), args.epochs + 1):
            run_epoch(epoch, 0)
    else:
        step0 = tg.start_step(0)
        for epoch in range(step0 // steps_per_epoch, args.epochs):
            run_epoch(epoch, step0 - epoch * steps_per_epoch if epoch == step0 // steps_per_epoch else 0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
