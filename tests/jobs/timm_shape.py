"""timm's train.py in small, ported from the docs (the shape a blind helper wrote): every rank seeded with seed + rank
before the model is built, `DDP(...)`, a model EMA copied from the wrapped model (timm's ModelEmaV2), gradient
accumulation of 2 under `no_sync()` whose epoch ends in a partial update (`last_batch = batch_idx == last_idx`, 15
batches an epoch), torch's CosineAnnealingWarmRestarts stepped with `epoch + batch_idx / iters` as its docs show,
clipping. Two things made a kill mid-epoch exit 0 with other weights:
- `enumerate(loader)` counted the resumed pass from 0, so `last_batch` was never true and the epoch's last update
  was never made (train/data/numbering.py);
- trainguard.DDP gave every rank rank 0's weights at the first step, not in its constructor, so an EMA copied after
  `DDP(...)` held each rank's own initial weights (train/parallel/ddp.py).
`--ema-before`: the EMA is copied before `DDP(...)`, as timm does it: each rank's differs, which the job says at its
start (train/engine/alike.py).

The batches come through torchvision's `MetricLogger.log_every`, a generator (`enumerate(metric_logger.log_every(
data_loader, print_freq, header))` in references/classification/train.py): an `enumerate` over it counted the
resumed pass from 0 after the first fix too (a blind port of that reference: its EMA, updated at
`i % model_ema_steps == 0`, took other batches).

--out FILE: rank 0 saves the model, the EMA, the optimizer and the scheduler.
"""

import argparse
import contextlib
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import trainguard as tg
from trainguard import DDP, DataLoader, DistributedSampler

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from digits_data import load_digits  # noqa: E402  (scikit-learn's digits, without its 2 s import)


class ModelEma(nn.Module):
    def __init__(self, model, decay=0.9):
        super().__init__()
        self.module = copy.deepcopy(model)
        self.module.eval()
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for e, m in zip(self.module.state_dict().values(), model.state_dict().values()):
            e.copy_(self.decay * e + (1.0 - self.decay) * m) if e.is_floating_point() else e.copy_(m)


def log_every(iterable, print_freq, header):
    """torchvision's MetricLogger.log_every, in small: a generator that prints every print_freq batches."""
    i = 0
    for obj in iterable:
        yield obj
        if i % print_freq == 0 and dist.get_rank() == 0:
            print(f"{header} [{i}/{len(iterable)}]", flush=True)
        i += 1


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--ema-before", action="store_true")
    p.add_argument("--out", default="")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(42 + rank)  # timm: random_seed(args.seed, args.rank)

    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X[:1350], dtype=torch.float32) / 16.0
    ds = TensorDataset(X, torch.tensor(y[:1350]))
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=30, sampler=sampler, drop_last=True)  # 15 batches a rank an epoch

    model = nn.Sequential(nn.Linear(64, 48), nn.BatchNorm1d(48), nn.ReLU(), nn.Dropout(0.2), nn.Linear(48, 10))
    ema = ModelEma(model) if args.ema_before else None
    model = DDP(model)
    if ema is None:
        ema = ModelEma(model.module)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=2)
    optimizer = tg.Optimizer(optimizer, lr_scheduler=scheduler)
    tg.register_state("model_ema", ema)

    accum, iters = 2, len(loader)
    for epoch in range(tg.start_epoch(0), args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        last_idx = iters - 1
        for batch_idx, (xb, yb) in enumerate(log_every(loader, 5, f"Epoch: [{epoch}]")):
            last_batch = batch_idx == last_idx
            need_update = last_batch or (batch_idx + 1) % accum == 0
            xb = xb + 0.05 * torch.randn_like(xb)
            with model.no_sync() if not need_update else contextlib.nullcontext():
                loss = F.cross_entropy(model(xb), yb, label_smoothing=0.1) / accum
                loss.backward()
            if not need_update:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            ema.update(model.module)
            scheduler.step(epoch + batch_idx / iters)
        if rank == 0:
            print(f"epoch {epoch} done: lr {optimizer.param_groups[0]['lr']:.6f}", flush=True)

    if rank == 0 and args.out:
        torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
