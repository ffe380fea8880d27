"""DDP image classification on sklearn's digits dataset, written for torchrun in the shape of pytorch/examples'
imagenet and timm's train.py by a helper who never saw trainguard. tests/jobs/imagenet_style.py is this script ported
to trainguard (4 lines).

Launch:
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 3 train.py --epochs 3
"""
import argparse
import math
import os
import random
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def get_args():
    p = argparse.ArgumentParser(description="DDP digits training")
    p.add_argument("--epochs", default=10, type=int)
    p.add_argument("-b", "--batch-size", default=32, type=int, help="per-process batch size")
    p.add_argument("--lr", default=0.1, type=float, help="base lr (for total batch 256, scaled linearly)")
    p.add_argument("--momentum", default=0.9, type=float)
    p.add_argument("--wd", "--weight-decay", dest="weight_decay", default=5e-4, type=float)
    p.add_argument("--opt", default="sgd", choices=["sgd", "adamw"])
    p.add_argument("--warmup-epochs", default=1, type=float)
    p.add_argument("--min-lr", default=1e-5, type=float)
    p.add_argument("--clip-grad", default=1.0, type=float, help="max grad norm (<=0 to disable)")
    p.add_argument("--label-smoothing", default=0.1, type=float)
    p.add_argument("--mixup-alpha", default=0.2, type=float, help="0 disables mixup")
    p.add_argument("--accum-steps", default=2, type=int, help="gradient accumulation steps")
    p.add_argument("--dropout", default=0.2, type=float)
    p.add_argument("--model-ema", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--model-ema-decay", default=0.99, type=float)
    p.add_argument("--workers", "-j", default=2, type=int)
    p.add_argument("--seed", default=42, type=int)
    p.add_argument("--output-dir", default="./output", type=str)
    p.add_argument("--resume", default="", type=str, help="path to checkpoint")
    p.add_argument("--start-epoch", default=0, type=int)
    p.add_argument("--print-freq", "-p", default=5, type=int)
    p.add_argument("--eval-freq", default=1, type=int, help="evaluate every N epochs")
    p.add_argument("--final-out", default="", type=str, help="where rank 0 saves final state_dict")
    return p.parse_args()


# --------------------------------------------------------------------------- #
# distributed helpers
# --------------------------------------------------------------------------- #
def init_distributed():
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        dist.init_process_group(backend="gloo", init_method="env://")
        dist.barrier()
        return True, rank, world_size, local_rank
    return False, 0, 1, 0


def is_main_process():
    return not dist.is_initialized() or dist.get_rank() == 0


def reduce_tensor(t, average=True):
    if not dist.is_initialized():
        return t
    rt = t.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    if average:
        rt /= dist.get_world_size()
    return rt


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def seed_worker(worker_id):
    # per-worker seed derived from the torch seed that the DataLoader assigns
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


class AverageMeter:
    """Computes and stores the average and current value"""

    def __init__(self, name, fmt=":f"):
        self.name = name
        self.fmt = fmt
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def all_reduce(self):
        t = torch.tensor([self.sum, self.count], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        self.sum, self.count = t.tolist()
        self.avg = self.sum / max(self.count, 1)

    def __str__(self):
        fmtstr = "{name} {val" + self.fmt + "} ({avg" + self.fmt + "})"
        return fmtstr.format(**self.__dict__)


def accuracy(output, target, topk=(1,)):
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)
        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        res = []
        for k in topk:
            correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
            res.append(correct_k.mul_(100.0 / batch_size))
        return res


# --------------------------------------------------------------------------- #
# data
# --------------------------------------------------------------------------- #
class DigitsDataset(Dataset):
    MEAN, STD = 0.3, 0.4  # approx stats of digits / 16

    def __init__(self, images, labels, train=True, pad=1, noise_std=0.05):
        self.images = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)  # N,1,8,8
        self.labels = torch.from_numpy(labels.astype(np.int64))
        self.train = train
        self.pad = pad
        self.noise_std = noise_std

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        img = self.images[idx]
        if self.train:
            # random shift: pad then random crop back to 8x8
            if self.pad > 0:
                padded = F.pad(img, (self.pad,) * 4)
                i = np.random.randint(0, 2 * self.pad + 1)
                j = np.random.randint(0, 2 * self.pad + 1)
                img = padded[:, i:i + 8, j:j + 8]
            # random small rotation-ish jitter via contrast scaling
            img = img * np.random.uniform(0.8, 1.2)
            # additive gaussian noise
            img = img + self.noise_std * torch.randn_like(img)
            img = img.clamp(0.0, 1.5)
        img = (img - self.MEAN) / self.STD
        return img, self.labels[idx]


def build_datasets(seed):
    digits = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(
        digits.images, digits.target, test_size=0.2, random_state=seed, stratify=digits.target
    )
    return DigitsDataset(x_tr, y_tr, train=True), DigitsDataset(x_te, y_te, train=False)


def mixup_data(x, y, alpha):
    lam = np.random.beta(alpha, alpha) if alpha > 0 else 1.0
    index = torch.randperm(x.size(0))
    mixed_x = lam * x + (1 - lam) * x[index]
    return mixed_x, y, y[index], lam


# --------------------------------------------------------------------------- #
# model
# --------------------------------------------------------------------------- #
class SmallCNN(nn.Module):
    def __init__(self, num_classes=10, dropout=0.2):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, padding=1, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),  # 4x4
            nn.Conv2d(64, 128, 3, padding=1, bias=False),
            nn.BatchNorm2d(128),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
        )
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(128, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.features(x).flatten(1)
        return self.fc(self.dropout(x))


def param_groups_weight_decay(model, weight_decay):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim <= 1 or name.endswith(".bias"):
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": no_decay, "weight_decay": 0.0},
        {"params": decay, "weight_decay": weight_decay},
    ]


def cosine_with_warmup(warmup_steps, total_steps, min_ratio):
    def lr_lambda(step):
        if step < warmup_steps:
            return float(step + 1) / float(max(1, warmup_steps))
        progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return lr_lambda


def save_checkpoint(state, is_best, output_dir, filename="checkpoint.pth"):
    path = os.path.join(output_dir, filename)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
    if is_best:
        shutil.copyfile(path, os.path.join(output_dir, "model_best.pth"))


# --------------------------------------------------------------------------- #
# train / eval
# --------------------------------------------------------------------------- #
def train_one_epoch(model, model_ema, criterion, optimizer, scheduler, loader, epoch, args):
    batch_time = AverageMeter("Time", ":6.3f")
    data_time = AverageMeter("Data", ":6.3f")
    losses = AverageMeter("Loss", ":.4e")
    lr_meter = AverageMeter("LR", ":.4e")

    model.train()
    num_batches = len(loader)
    end = time.time()
    optimizer.zero_grad(set_to_none=True)
    for i, (images, target) in enumerate(loader):
        data_time.update(time.time() - end)

        if args.mixup_alpha > 0:
            images, y_a, y_b, lam = mixup_data(images, target, args.mixup_alpha)

        is_update_step = ((i + 1) % args.accum_steps == 0) or (i + 1 == num_batches)
        # skip gradient all-reduce on accumulation micro-steps
        ctx = model.no_sync() if (not is_update_step and isinstance(model, DDP)) else _nullctx()
        with ctx:
            output = model(images)
            if args.mixup_alpha > 0:
                loss = lam * criterion(output, y_a) + (1 - lam) * criterion(output, y_b)
            else:
                loss = criterion(output, target)
            (loss / args.accum_steps).backward()

        if is_update_step:
            if args.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            if model_ema is not None:
                model_ema.update_parameters(model.module if isinstance(model, DDP) else model)

        losses.update(loss.item(), images.size(0))
        lr_meter.update(optimizer.param_groups[0]["lr"])
        batch_time.update(time.time() - end)
        end = time.time()

        if is_main_process() and (i % args.print_freq == 0 or i + 1 == num_batches):
            print(f"Epoch: [{epoch}][{i:>3}/{num_batches}]  {batch_time}  {data_time}  {losses}  "
                  f"lr {optimizer.param_groups[0]['lr']:.5f}", flush=True)

    losses.all_reduce()
    return losses.avg


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@torch.no_grad()
def evaluate(model, loader, criterion, tag="Test"):
    losses = AverageMeter("Loss", ":.4e")
    top1 = AverageMeter("Acc@1", ":6.2f")
    top5 = AverageMeter("Acc@5", ":6.2f")
    model.eval()
    for images, target in loader:
        output = model(images)
        loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1.item(), images.size(0))
        top5.update(acc5.item(), images.size(0))
    for m in (losses, top1, top5):
        m.all_reduce()
    if is_main_process():
        print(f" * {tag}: Acc@1 {top1.avg:.3f} Acc@5 {top5.avg:.3f} Loss {losses.avg:.4f}", flush=True)
    return top1.avg


def main():
    args = get_args()
    distributed, rank, world_size, local_rank = init_distributed()
    device = torch.device("cpu")

    seed_everything(args.seed + rank)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True

    if is_main_process():
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"world_size={world_size} args={vars(args)}", flush=True)

    # ---------------- data ----------------
    train_set, val_set = build_datasets(args.seed)
    if distributed:
        train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                           shuffle=True, seed=args.seed, drop_last=False)
        val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)
    else:
        train_sampler, val_sampler = None, None

    g = torch.Generator()
    g.manual_seed(args.seed + rank)
    train_loader = DataLoader(
        train_set, batch_size=args.batch_size, shuffle=(train_sampler is None),
        sampler=train_sampler, num_workers=args.workers, pin_memory=torch.cuda.is_available(),
        drop_last=True, worker_init_fn=seed_worker, generator=g,
        persistent_workers=args.workers > 0,
    )
    val_loader = DataLoader(
        val_set, batch_size=args.batch_size * 2, shuffle=False, sampler=val_sampler,
        num_workers=args.workers, pin_memory=torch.cuda.is_available(),
        persistent_workers=args.workers > 0,
    )

    # ---------------- model ----------------
    model = SmallCNN(num_classes=10, dropout=args.dropout).to(device)
    model_ema = None
    if args.model_ema:
        model_ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(args.model_ema_decay),
                                  use_buffers=True)
    model_without_ddp = model
    if distributed:
        model = DDP(model)  # CPU: no device_ids
        model_without_ddp = model.module

    # linear lr scaling rule
    eff_batch = args.batch_size * world_size * args.accum_steps
    lr = args.lr * eff_batch / 256.0
    params = param_groups_weight_decay(model_without_ddp, args.weight_decay)
    if args.opt == "sgd":
        optimizer = torch.optim.SGD(params, lr=lr, momentum=args.momentum, nesterov=True)
    else:
        optimizer = torch.optim.AdamW(params, lr=lr)

    steps_per_epoch = math.ceil(len(train_loader) / args.accum_steps)
    total_steps = steps_per_epoch * args.epochs
    warmup_steps = int(args.warmup_epochs * steps_per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_with_warmup(warmup_steps, total_steps, args.min_lr / lr))

    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    val_criterion = nn.CrossEntropyLoss()

    best_acc = 0.0
    if args.resume:
        if os.path.isfile(args.resume):
            if is_main_process():
                print(f"=> loading checkpoint '{args.resume}'", flush=True)
            ckpt = torch.load(args.resume, map_location="cpu", weights_only=False)
            model_without_ddp.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            scheduler.load_state_dict(ckpt["scheduler"])
            args.start_epoch = ckpt["epoch"] + 1
            best_acc = ckpt.get("best_acc", 0.0)
            if model_ema is not None and ckpt.get("model_ema") is not None:
                model_ema.load_state_dict(ckpt["model_ema"])
            if is_main_process():
                print(f"=> loaded checkpoint (epoch {ckpt['epoch']}, best_acc {best_acc:.2f})", flush=True)
        elif is_main_process():
            print(f"=> no checkpoint found at '{args.resume}'", flush=True)

    # ---------------- loop ----------------
    start = time.time()
    for epoch in range(args.start_epoch, args.epochs):
        if distributed:
            train_sampler.set_epoch(epoch)
        train_loss = train_one_epoch(model, model_ema, criterion, optimizer, scheduler,
                                     train_loader, epoch, args)
        if is_main_process():
            print(f"Epoch {epoch} train loss {train_loss:.4f}", flush=True)

        is_best = False
        if (epoch + 1) % args.eval_freq == 0 or epoch + 1 == args.epochs:
            acc1 = evaluate(model, val_loader, val_criterion)
            if model_ema is not None:
                evaluate(model_ema, val_loader, val_criterion, tag="Test (EMA)")
            is_best = acc1 > best_acc
            best_acc = max(acc1, best_acc)

        if is_main_process():
            save_checkpoint({
                "epoch": epoch,
                "model": model_without_ddp.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "best_acc": best_acc,
                "model_ema": model_ema.state_dict() if model_ema is not None else None,
                "args": vars(args),
            }, is_best, args.output_dir)
        if distributed:
            dist.barrier()

    if is_main_process():
        print(f"Training done in {time.time() - start:.1f}s, best Acc@1 {best_acc:.3f}", flush=True)
        if args.final_out:
            torch.save(model_without_ddp.state_dict(), args.final_out)

    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
