"""A trainer written for torchrun by someone else, never edited for trainguard: tests/test_foreign_trainer.py ports
it the way a user does (imports, `init`, the optimizer wrapped with the scheduler it steps every step, the loops'
starting points) and runs the port. What the port does not mention is what it tests: a `ReduceLROnPlateau`
stepped on the eval loss at each epoch's end and an EMA (`AveragedModel`) updated every step, neither given to
trainguard; a validation every few steps inside the epoch (an all_reduce, an all_gather_object, a
broadcast_object_list); bf16 autocast; loader workers that persist across epochs; gradient clipping through a
GradScaler (disabled on CPU, as AMP code leaves it).

    torchrun --standalone --nproc-per-node 3 tests/jobs/foreign_trainer.py --epochs 3 --out OUT

Rank 0 prints each validation's loss; with --out every rank writes its final state to OUT/rank_R.pt.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).flatten(1) / 16.0
    labels = torch.tensor(digits.target)
    train_set, val_set = TensorDataset(images[:1300], labels[:1300]), TensorDataset(images[1300:], labels[1300:])
    train_loader = DataLoader(train_set, batch_size=16, sampler=DistributedSampler(train_set, drop_last=True),
                              drop_last=True, num_workers=2, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=50, sampler=DistributedSampler(val_set, shuffle=False))

    model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=10)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    model = DDP(model)
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def validate():
        model.eval()
        totals = torch.zeros(2)
        with torch.no_grad():
            for x, y in val_loader:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
                totals += torch.tensor([F.cross_entropy(out.float(), y, reduction="sum").item(), len(y)])
        dist.all_reduce(totals)
        counts = [None] * world
        dist.all_gather_object(counts, int(totals[1]))
        assert sum(counts) == world * int(totals[1])
        model.train()
        return (totals[0] / totals[1]).item()

    global_step = 0
    for epoch in range(args.epochs):
        train_loader.sampler.set_epoch(epoch)
        for x, y in train_loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x).float(), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            scaler.step(optimizer)
            scaler.update()
            warmup.step()
            ema.update_parameters(model.module)
            global_step += 1
            if global_step % args.eval_every == 0:
                shared = [validate()]
                dist.broadcast_object_list(shared, src=0)
                if rank == 0:
                    print(f"step {global_step} val {shared[0]!r}", flush=True)
        val = validate()
        plateau.step(val)
        if rank == 0:
            print(f"epoch {epoch} val {val!r} lr {optimizer.param_groups[0]['lr']!r}", flush=True)
        dist.barrier()

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(), "optimizer": optimizer.state_dict(),
                    "warmup": warmup.state_dict(), "plateau": plateau.state_dict()},
                   os.path.join(args.out, f"rank_{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
