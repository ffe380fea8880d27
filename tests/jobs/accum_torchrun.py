"""DDP image classification on sklearn's digits dataset with gradient accumulation, written for torchrun by a helper
who never saw trainguard (nanoGPT's and timm's habits: a step takes the next `--accum-steps` batches from an iterator
of the loader, `for step in range(steps_per_epoch)`, a short last step caught from StopIteration, `no_sync` on all but
the last micro-batch, the loss divided by their number, AdamW, warm-up and cosine LambdaLR, clipping). Ported in
tests/jobs/accum.py (4 lines) and, on virtual shards, in tests/jobs/accum_vshards.py.

Launch:
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 accum_torchrun.py --epochs 2 --out out
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    parser = argparse.ArgumentParser(description="DDP digits training")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8, help="per-rank micro-batch size")
    parser.add_argument("--accum-steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--min-lr", type=float, default=1e-4)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--clip-grad", type=float, default=1.0)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--out", type=str, default="out")
    return parser.parse_args()


class DigitsDataset(Dataset):
    def __init__(self, split="train", n_train=1440):
        digits = load_digits()
        images = digits.images.astype(np.float32) / 16.0
        targets = digits.target.astype(np.int64)
        if split == "train":
            images, targets = images[:n_train], targets[:n_train]
        else:
            images, targets = images[n_train:], targets[n_train:]
        self.images = images
        self.targets = targets

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, idx):
        img = torch.from_numpy(self.images[idx]).unsqueeze(0)
        return img, int(self.targets[idx])


class SmallCNN(nn.Module):
    def __init__(self, num_classes=10, dropout=0.1):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
        )
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(64, num_classes)

    def forward(self, x):
        x = self.features(x)
        x = torch.flatten(x, 1)
        x = self.dropout(x)
        return self.head(x)


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def seed_worker(worker_id):
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def build_optimizer(model, lr, weight_decay):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim <= 1:
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr)


def build_scheduler(optimizer, warmup_steps, total_steps, lr, min_lr):
    min_ratio = min_lr / lr

    def lr_lambda(step):
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        progress = min(progress, 1.0)
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_ratio + coeff * (1.0 - min_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def train_one_epoch(model, loader, optimizer, scheduler, epoch, args, rank, global_step):
    model.train()
    steps_per_epoch = math.ceil(len(loader) / args.accum_steps)
    data_iter = iter(loader)
    running_loss = 0.0
    t0 = time.time()

    for step in range(steps_per_epoch):
        micro_batches = []
        for _ in range(args.accum_steps):
            try:
                micro_batches.append(next(data_iter))
            except StopIteration:
                break
        num_micro = len(micro_batches)

        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for micro_step, (images, targets) in enumerate(micro_batches):
            is_last = micro_step == num_micro - 1
            if is_last:
                output = model(images)
                loss = F.cross_entropy(output, targets) / num_micro
                loss.backward()
            else:
                with model.no_sync():
                    output = model(images)
                    loss = F.cross_entropy(output, targets) / num_micro
                    loss.backward()
            step_loss += loss.item()

        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        optimizer.step()
        scheduler.step()
        global_step += 1
        running_loss += step_loss

        if rank == 0 and (step % args.log_interval == 0 or step == steps_per_epoch - 1):
            lr = optimizer.param_groups[0]["lr"]
            dt = time.time() - t0
            print(
                f"epoch {epoch} step {step + 1}/{steps_per_epoch} "
                f"loss {step_loss:.4f} grad_norm {grad_norm.item():.4f} "
                f"lr {lr:.6f} time {dt:.2f}s",
                flush=True,
            )

    return global_step, running_loss / max(1, steps_per_epoch)


@torch.no_grad()
def validate(model, loader):
    model.eval()
    loss_sum = torch.zeros(1, dtype=torch.float64)
    correct = torch.zeros(1, dtype=torch.float64)
    count = torch.zeros(1, dtype=torch.float64)
    for images, targets in loader:
        output = model(images)
        loss_sum += F.cross_entropy(output, targets, reduction="sum").double()
        correct += (output.argmax(dim=1) == targets).sum().double()
        count += targets.numel()
    stats = torch.cat([loss_sum, correct, count])
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    loss_sum, correct, count = stats.tolist()
    return loss_sum / count, 100.0 * correct / count


def main():
    args = get_args()

    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    world_size = dist.get_world_size()

    seed_everything(args.seed)
    torch.use_deterministic_algorithms(True)

    train_dataset = DigitsDataset("train")
    val_dataset = DigitsDataset("val")

    train_sampler = DistributedSampler(
        train_dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed
    )
    val_sampler = DistributedSampler(
        val_dataset, num_replicas=world_size, rank=rank, shuffle=False, drop_last=False
    )

    g = torch.Generator()
    g.manual_seed(args.seed)
    train_loader = DataLoader(
        train_dataset,
        batch_size=args.batch_size,
        sampler=train_sampler,
        num_workers=args.workers,
        worker_init_fn=seed_worker,
        generator=g,
        drop_last=False,
    )
    val_loader = DataLoader(
        val_dataset,
        batch_size=args.batch_size,
        sampler=val_sampler,
        num_workers=args.workers,
    )

    model = SmallCNN(num_classes=10, dropout=args.dropout)
    model = DDP(model)

    optimizer = build_optimizer(model.module, args.lr, args.weight_decay)
    steps_per_epoch = math.ceil(len(train_loader) / args.accum_steps)
    total_steps = args.epochs * steps_per_epoch
    scheduler = build_scheduler(optimizer, args.warmup_steps, total_steps, args.lr, args.min_lr)

    if rank == 0:
        print(
            f"world_size {world_size} per-rank batch {args.batch_size} accum {args.accum_steps} "
            f"effective batch {args.batch_size * args.accum_steps * world_size} "
            f"steps/epoch {steps_per_epoch} total steps {total_steps}",
            flush=True,
        )

    global_step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        global_step, train_loss = train_one_epoch(
            model, train_loader, optimizer, scheduler, epoch, args, rank, global_step
        )
        val_loss, val_acc = validate(model, val_loader)
        if rank == 0:
            print(
                f"epoch {epoch} train_loss {train_loss:.4f} "
                f"val_loss {val_loss:.4f} val_acc {val_acc:.2f}%",
                flush=True,
            )

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        checkpoint = {
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        }
        torch.save(checkpoint, os.path.join(args.out, "final.pt"))
        print(f"saved {os.path.join(args.out, 'final.pt')}", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
