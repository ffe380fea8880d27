"""A trainer that keeps its early-stop state in plain variables, as the blind bucketing port did: `best_val_loss` and
`bad_epochs` in `main()`, an eval at each epoch's end (all_reduced), a stop after `--patience` epochs without a
better loss; and, beside them, a running sum for the log line and a step timer, which change at every step.

After a rewind the script runs again: `best_val_loss` is `inf` again, and the job says so when the step it resumed
at begins (train/engine/plainvars.py); the running sum and the timer are not named.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import trainguard as tg
from trainguard import DDP, DataLoader, DistributedSampler


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--patience", type=int, default=2)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(240, 8), torch.randint(0, 3, (240,)))
    val = TensorDataset(torch.randn(60, 8), torch.randint(0, 3, (60,)))
    loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds))  # 10 steps an epoch on 3 ranks
    val_loader = DataLoader(val, batch_size=20, sampler=DistributedSampler(val, shuffle=False))
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)))
    optimizer = tg.Optimizer(torch.optim.SGD(model.parameters(), lr=0.05))

    best_val_loss, bad_epochs = float("inf"), 0
    for epoch in range(tg.start_epoch(0), args.epochs):
        loader.sampler.set_epoch(epoch)
        running_loss, t0 = 0.0, time.perf_counter()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
            dt = time.perf_counter() - t0  # noqa: F841  (a timer, as nanoGPT's)
        with torch.no_grad():
            total = torch.zeros(2)
            for x, y in val_loader:
                total += torch.tensor([F.cross_entropy(model(x), y, reduction="sum").item(), len(y)])
            dist.all_reduce(total)
        val_loss = (total[0] / total[1]).item()
        if val_loss < best_val_loss:
            best_val_loss, bad_epochs = val_loss, 0
        else:
            bad_epochs += 1
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: train {running_loss / len(loader):.4f} val {val_loss:.4f} best {best_val_loss:.4f}",
                  flush=True)
        if bad_epochs >= args.patience:
            break


if __name__ == "__main__":
    main()
