"""A trainer written the way people write them for torchrun (no trainguard): train and eval loaders,
BatchNorm and dropout, an LR schedule stepped every step, gradient accumulation with no_sync, gradient
clipping, an eval metric reduced with all_reduce, an early-stop flag broadcast from rank 0, a barrier per
epoch, and rank 0's own snapshot (model, optimizer, scheduler) that every rank resumes from.
examples/trainer.py is this script ported to trainguard (diff the two files).

    torchrun --standalone --nproc-per-node 3 examples/trainer_torchrun.py --epochs 4
    trainguard run --workers 3 examples/trainer.py --epochs 4

Rank 0 prints each epoch's eval loss and accuracy (exact reprs). With --out DIR every rank writes its
final model, optimizer and scheduler state to DIR/rank_R.pt.
"""

import argparse
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from digits_data import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

# --- arguments -------------------------------------------------------------------------------------
parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--batch-size", type=int, default=20)
parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
parser.add_argument("--stop-accuracy", type=float, default=2.0, help="stop early above this eval accuracy")
parser.add_argument("--snapshot", default="snapshot.pt")
parser.add_argument("--out", default="")
args = parser.parse_args()

# --- setup ----------------------------------------------------------------------------------------
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)

digits = load_digits()
images = torch.tensor(digits.images, dtype=torch.float32).flatten(1) / 16.0
labels = torch.tensor(digits.target, dtype=torch.int64)
train_set = TensorDataset(images[:1440], labels[:1440])
eval_set = TensorDataset(images[1440:], labels[1440:])
train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=DistributedSampler(train_set, seed=0))
eval_loader = DataLoader(eval_set, batch_size=64, sampler=DistributedSampler(eval_set, shuffle=False))

model = nn.Sequential(nn.Linear(64, 96), nn.BatchNorm1d(96), nn.ReLU(), nn.Dropout(0.2),
                      nn.Linear(96, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
steps_per_epoch = len(train_loader) // args.accumulate
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.2, total_steps=args.epochs * steps_per_epoch)

start_epoch = 0
if os.path.exists(args.snapshot):
    snapshot = torch.load(args.snapshot, map_location="cpu", weights_only=True)
    model.load_state_dict(snapshot["model"])
    optimizer.load_state_dict(snapshot["optimizer"])
    scheduler.load_state_dict(snapshot["scheduler"])
    start_epoch = snapshot["epoch"]
    print(f"[rank {rank}] resuming from {args.snapshot} at epoch {start_epoch}", flush=True)
model = DDP(model)


# --- evaluation -----------------------------------------------------------------------------------
def evaluate():
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    with torch.no_grad():
        for x, y in eval_loader:
            out = model(x)
            totals += torch.tensor([F.cross_entropy(out, y, reduction="sum").item(),
                                    (out.argmax(1) == y).sum().item(), len(y)], dtype=torch.float64)
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


# --- training -------------------------------------------------------------------------------------
for epoch in range(start_epoch, args.epochs):
    train_loader.sampler.set_epoch(epoch)
    model.train()
    for i, (x, y) in enumerate(train_loader):
        last = (i + 1) % args.accumulate == 0 or i + 1 == len(train_loader)
        with nullcontext() if last else model.no_sync():
            loss = F.cross_entropy(model(x), y) / args.accumulate
            loss.backward()
        if last:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    eval_loss, accuracy = evaluate()
    if rank == 0:
        print(f"epoch {epoch} eval_loss {eval_loss!r} accuracy {accuracy!r} lr {scheduler.get_last_lr()[0]!r}",
              flush=True)
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch + 1}, args.snapshot)
    stop = torch.tensor([int(accuracy > args.stop_accuracy)])
    dist.broadcast(stop, 0)
    dist.barrier()
    if stop.item():
        break

# --- the end --------------------------------------------------------------------------------------
if args.out:
    os.makedirs(args.out, exist_ok=True)
    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, os.path.join(args.out, f"rank_{rank}.pt"))
dist.destroy_process_group()
