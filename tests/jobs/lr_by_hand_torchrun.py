"""An MLP on sklearn's digits, written for torchrun by a helper who never saw trainguard, in the shape of Hugging
Face's `run_*_no_trainer.py` and many research loops: the LR computed by hand from a `global_step` the script
keeps and written into `param_groups`, an eval every 25 steps after `optimizer.step()` (all_reduced), `best_val_loss`
and early stopping broadcast from rank 0, rank 0's `best.pt`. Ported in tests/jobs/lr_by_hand.py.

Launch:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 lr_by_hand_torchrun.py --out out
"""
import argparse
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--min-lr", type=float, default=0.0)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--patience", type=int, default=100)
    p.add_argument("--val-size", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", type=str, default="out")
    return p.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class MLP(nn.Module):
    def __init__(self, in_dim, hidden, n_classes, dropout):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden),
            nn.LayerNorm(hidden),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.LayerNorm(hidden),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, n_classes),
        )

    def forward(self, x):
        return self.net(x)


def get_lr(step, args, total_steps):
    # linear warmup, then cosine decay down to min_lr
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
    progress = min(progress, 1.0)
    coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    return args.min_lr + coeff * (args.lr - args.min_lr)


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    loss_sum = torch.zeros(1)
    correct = torch.zeros(1)
    count = torch.zeros(1)
    for x, y in loader:
        logits = model(x)
        loss_sum += F.cross_entropy(logits, y, reduction="sum")
        correct += (logits.argmax(dim=1) == y).sum()
        count += y.numel()
    dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
    dist.all_reduce(correct, op=dist.ReduceOp.SUM)
    dist.all_reduce(count, op=dist.ReduceOp.SUM)
    model.train()
    return (loss_sum / count).item(), (correct / count).item()


def main():
    args = parse_args()

    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    is_main = rank == 0

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    set_seed(args.seed)

    # ---- data ----
    X, y = load_digits(return_X_y=True)
    X_train, X_val, y_train, y_val = train_test_split(
        X, y, test_size=args.val_size, random_state=args.seed, stratify=y
    )
    scaler = StandardScaler().fit(X_train)
    X_train = scaler.transform(X_train)
    X_val = scaler.transform(X_val)

    train_ds = TensorDataset(
        torch.tensor(X_train, dtype=torch.float32), torch.tensor(y_train, dtype=torch.long)
    )
    val_ds = TensorDataset(
        torch.tensor(X_val, dtype=torch.float32), torch.tensor(y_val, dtype=torch.long)
    )

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(
        train_ds, batch_size=args.batch_size, sampler=train_sampler, drop_last=True
    )
    val_loader = DataLoader(val_ds, batch_size=256, sampler=val_sampler)

    # ---- model / optimizer ----
    model = MLP(X.shape[1], args.hidden, int(y.max()) + 1, args.dropout)
    model = DDP(model)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=args.lr,
        momentum=args.momentum,
        nesterov=True,
        weight_decay=args.weight_decay,
    )

    # per-rank dropout RNG: same seed everywhere would give identical masks
    torch.manual_seed(args.seed + rank)

    total_steps = args.epochs * len(train_loader)
    if is_main:
        os.makedirs(args.out, exist_ok=True)
        print(
            f"world_size={world_size} train={len(train_ds)} val={len(val_ds)} "
            f"steps/epoch={len(train_loader)} total_steps={total_steps}"
        )

    global_step = 0
    best_val_loss = float("inf")
    evals_since_improvement = 0
    running_loss = 0.0
    stop = False

    model.train()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(train_loader):
            lr = get_lr(global_step, args, total_steps)
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr

            logits = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            global_step += 1

            running_loss += loss.item()
            if global_step % args.log_every == 0:
                if is_main:
                    print(
                        f"epoch {epoch} step {global_step} lr {lr:.5f} "
                        f"train_loss {running_loss / args.log_every:.4f}"
                    )
                running_loss = 0.0

            if global_step % args.eval_every == 0:
                val_loss, val_acc = evaluate(model, val_loader)
                if val_loss < best_val_loss:
                    best_val_loss = val_loss
                    evals_since_improvement = 0
                    if is_main:
                        torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
                else:
                    evals_since_improvement += 1
                if is_main:
                    print(
                        f"  eval step {global_step}: val_loss {val_loss:.4f} "
                        f"val_acc {val_acc:.4f} best {best_val_loss:.4f}"
                    )

                stop_flag = torch.tensor(
                    [int(is_main and evals_since_improvement >= args.patience)]
                )
                dist.broadcast(stop_flag, src=0)
                if stop_flag.item():
                    if is_main:
                        print(f"early stopping at step {global_step}")
                    stop = True
                    break
        if stop:
            break

    if is_main:
        checkpoint = {
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "global_step": global_step,
            "best_val_loss": best_val_loss,
        }
        torch.save(checkpoint, os.path.join(args.out, "final.pt"))
        print(f"saved {os.path.join(args.out, 'final.pt')}")

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
