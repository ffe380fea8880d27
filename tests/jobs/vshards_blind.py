"""A digits CNN trainer written blind for torchrun (a helper given no sight of trainguard's code: augmentation from
torch's global generator in `__getitem__`, BatchNorm, dropout, SGD with OneCycleLR stepped per batch, epochs
numbered from 1, validation accuracy all-reduced), then ported by the same helper from the README's virtual-shards
section: the imports, `tg.micro_batches`, `tg.Optimizer`, `tg.start_epoch(1)`. tests/test_virtual_shards.py.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import Dataset
import trainguard as tg
from trainguard import DDP, DataLoader, DistributedSampler


class DigitsDataset(Dataset):
    def __init__(self, train=True, augment=True):
        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target, dtype=torch.long)
        n_train = 1400
        if train:
            self.x, self.y = x[:n_train], y[:n_train]
        else:
            self.x, self.y = x[n_train:], y[n_train:]
        self.augment = augment

    def __len__(self):
        return len(self.y)

    def __getitem__(self, idx):
        img = self.x[idx].unsqueeze(0)  # 1x8x8
        if self.augment:
            # random shift of up to 1 pixel
            dx, dy = torch.randint(-1, 2, (2,)).tolist()
            img = torch.roll(img, shifts=(dy, dx), dims=(1, 2))
            # gaussian noise
            img = img + 0.05 * torch.randn_like(img)
            # random contrast
            img = img * (0.9 + 0.2 * torch.rand(1))
        return img, self.y[idx]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = torch.flatten(x, 1)
        x = self.dropout(F.relu(self.fc1(x)))
        return self.fc2(x)


def train(model, loader, optimizer, scheduler, epoch, rank):
    model.train()
    for batch_idx, (data, target) in enumerate(loader):
        optimizer.zero_grad()
        for xs, ys in tg.micro_batches(data, target):
            loss = F.cross_entropy(model(xs), ys)
            loss.backward()
        optimizer.step()
        scheduler.step()
        if rank == 0 and batch_idx % 20 == 0:
            print(f"Train Epoch: {epoch} [{batch_idx}/{len(loader)}] loss: {loss.item():.4f}")


def validate(model, loader, epoch, rank):
    model.eval()
    correct = torch.zeros(1)
    total = torch.zeros(1)
    with torch.no_grad():
        for data, target in loader:
            pred = model(data).argmax(dim=1)
            correct += (pred == target).sum()
            total += target.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    if rank == 0:
        print(f"Epoch {epoch} val accuracy: {100.0 * correct.item() / total.item():.2f}%")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=str, default="model.pt")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    torch.manual_seed(args.seed)

    train_ds = DigitsDataset(train=True, augment=True)
    val_ds = DigitsDataset(train=False, augment=False)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=val_sampler)

    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, epochs=args.epochs, steps_per_epoch=len(train_loader))

    optimizer = tg.Optimizer(optimizer, lr_scheduler=scheduler)
    for epoch in range(tg.start_epoch(1), args.epochs + 1):
        train_sampler.set_epoch(epoch)
        train(model, train_loader, optimizer, scheduler, epoch, rank)
        validate(model, val_loader, epoch, rank)

    if rank == 0:
        torch.save({"model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, args.out)
        print(f"saved {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
