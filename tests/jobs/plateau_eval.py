"""A DDP trainer written blind (a helper that never saw trainguard's code) in a common shape: a loop counted in global
steps, an evaluation every 7 steps that steps a ReduceLROnPlateau on the validation loss and keeps an early-stop
record (a registered object) with its flag broadcast from rank 0, a random input mask drawn in the loop, label
smoothing. Ported from the docs: the eval moved to the top of the loop body, as they say. A kill inside that eval,
after the scheduler stepped and before the broadcast, sent the survivors back to the committed step with the
scheduler already stepped, and the eval ran again: the LR halved a step early, other weights, exit 0
(tests/test_ported_trainers.py; train/data/passes.py: `step_state`).

--out FILE: rank 0 saves the model, optimizer, scheduler, global step and best validation loss.
"""

import argparse
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import trainguard as tg
from trainguard import DDP, DataLoader, DistributedSampler

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from digits_data import load_digits  # noqa: E402  (scikit-learn's digits, without its 2 s import)


def get_data(seed=0):
    X, y = load_digits(return_X_y=True)
    X = X.astype(np.float32)
    rng = np.random.RandomState(seed)
    perm = rng.permutation(len(X))
    n_val = len(X) // 5
    val_idx, tr_idx = perm[:n_val], perm[n_val:]
    mean = X[tr_idx].mean(axis=0)
    std = X[tr_idx].std(axis=0) + 1e-6
    X = (X - mean) / std
    train = TensorDataset(torch.from_numpy(X[tr_idx]), torch.from_numpy(y[tr_idx]).long())
    val = TensorDataset(torch.from_numpy(X[val_idx]), torch.from_numpy(y[val_idx]).long())
    return train, val


class MLP(nn.Module):
    def __init__(self, d_in, d_hidden=32, n_out=10, p=0.2):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, d_hidden),
            nn.BatchNorm1d(d_hidden),
            nn.ReLU(),
            nn.Dropout(p),
            nn.Linear(d_hidden, d_hidden),
            nn.BatchNorm1d(d_hidden),
            nn.ReLU(),
            nn.Dropout(p),
            nn.Linear(d_hidden, n_out),
        )

    def forward(self, x):
        return self.net(x)


class EarlyStop:
    def __init__(self):
        self.best_val, self.bad_evals = float("inf"), 0

    def state_dict(self):
        return {"best_val": self.best_val, "bad_evals": self.bad_evals}

    def load_state_dict(self, sd):
        self.best_val, self.bad_evals = sd["best_val"], sd["bad_evals"]


@torch.no_grad()
def evaluate(model, val_loader):
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for x, y in val_loader:
        out = model(x)
        total[0] += F.cross_entropy(out, y, reduction="sum").double()
        total[1] += y.numel()
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--out", type=str, default="final.pt")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--eval-every", type=int, default=7)
    p.add_argument("--patience", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()

    torch.manual_seed(args.seed + rank)

    train_ds, val_ds = get_data(seed=0)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=32, sampler=sampler, drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=val_sampler)

    torch.manual_seed(args.seed)  # same init on every rank
    model = MLP(train_ds.tensors[0].shape[1])
    model = DDP(model)
    torch.manual_seed(args.seed + rank)  # per-rank dropout / mask streams

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=1)
    optimizer = tg.Optimizer(optimizer, lr_scheduler=scheduler)
    es = EarlyStop()
    tg.register_state("early_stop", es)

    global_step = tg.start_step(0)
    stop = False
    model.train()
    for epoch in range(tg.start_epoch(0), args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            if global_step > 0 and global_step % args.eval_every == 0:  # moved: eval of the step before
                val_loss = evaluate(model, val_loader)
                scheduler.step(val_loss)
                if val_loss < es.best_val:
                    es.best_val = val_loss
                    es.bad_evals = 0
                    if rank == 0:
                        torch.save(model.module.state_dict(), args.out + ".best")
                else:
                    es.bad_evals += 1
                flag = torch.tensor([1 if es.bad_evals >= args.patience else 0])
                dist.broadcast(flag, src=0)
                if rank == 0:
                    print(f"step {global_step} epoch {epoch} val {val_loss:.4f} "
                          f"lr {optimizer.param_groups[0]['lr']:.4g} bad {es.bad_evals}", flush=True)
                if flag.item():
                    stop = True
                    break

            mask = (torch.rand_like(x) > 0.1).float()
            x = x * mask
            out = model(x)
            loss = F.cross_entropy(out, y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            global_step += 1
        if stop:
            break

    if rank == 0:
        torch.save(
            {
                "model": model.module.state_dict(),
                "opt": optimizer.state_dict(),
                "sched": scheduler.state_dict(),
                "global_step": global_step,
                "best_val": es.best_val,
            },
            args.out,
        )
        print(f"saved {args.out} global_step={global_step} best_val={es.best_val}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
