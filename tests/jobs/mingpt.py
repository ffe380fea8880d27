"""
minGPT-ddp style trainer, CPU only (gloo), launched with torchrun.

    trainguard run --workers 3 mingpt.py --max-epochs 4     (mingpt_torchrun.py, ported)

Shape follows pytorch/examples distributed/minGPT-ddp (mingpt/trainer.py + main.py),
with a tiny char-level MLP instead of the GPT so that it runs in seconds on a laptop.
"""

import argparse
import collections
import functools
import inspect
import json.decoder
import os
import textwrap
from collections import OrderedDict
from dataclasses import dataclass, asdict
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import init_process_group, destroy_process_group
from torch.utils.data import Dataset, random_split
from trainguard import DDP, DataLoader, DistributedSampler, Optimizer, start_epoch


@dataclass
class TrainerConfig:
    max_epochs: int = None
    batch_size: int = None
    data_loader_workers: int = None
    grad_norm_clip: float = None
    snapshot_path: Optional[str] = None
    save_every: int = None


@dataclass
class Snapshot:
    model_state: 'OrderedDict[str, torch.Tensor]'
    optimizer_state: Dict[str, Any]
    scheduler_state: Dict[str, Any]
    finished_epoch: int


class CharDataset(Dataset):
    def __init__(self, data: str, block_size: int):
        chars = sorted(list(set(data)))
        self.stoi = {ch: i for i, ch in enumerate(chars)}
        self.itos = {i: ch for i, ch in enumerate(chars)}
        self.block_size = block_size
        self.vocab_size = len(chars)
        self.data = data

    def __len__(self):
        return len(self.data) - self.block_size

    def __getitem__(self, idx):
        # grab a chunk of (block_size + 1) characters from the data
        chunk = self.data[idx:idx + self.block_size + 1]
        dix = [self.stoi[s] for s in chunk]
        x = torch.tensor(dix[:-1], dtype=torch.long)
        y = torch.tensor(dix[-1], dtype=torch.long)  # next character after the block
        return x, y


class CharMLP(nn.Module):
    def __init__(self, vocab_size, block_size, n_embd=16, n_hidden=128, dropout=0.1):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.fc1 = nn.Linear(block_size * n_embd, n_hidden)
        self.bn = nn.BatchNorm1d(n_hidden)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(n_hidden, vocab_size)

    def forward(self, idx, targets=None):
        x = self.tok_emb(idx).flatten(1)
        x = self.drop(F.relu(self.bn(self.fc1(x))))
        logits = self.head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits, targets)
        return logits, loss


class Trainer:

    def __init__(self, trainer_config: TrainerConfig, model, optimizer, scheduler, train_dataset, test_dataset=None):
        self.config = trainer_config
        # set torchrun variables
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        # data stuff
        self.train_dataset = train_dataset
        self.train_loader = self._prepare_dataloader(train_dataset)
        self.test_loader = self._prepare_dataloader(test_dataset) if test_dataset else None
        # initialize train states
        self.epochs_run = 0
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.save_every = self.config.save_every
        # load snapshot if available
        if self.config.snapshot_path is None:
            self.config.snapshot_path = "snapshot.pt"
        self._load_snapshot()
        # wrap with DDP. this step will synch model across all the processes.
        self.model = DDP(self.model)

    def _prepare_dataloader(self, dataset: Dataset):
        return DataLoader(
            dataset,
            batch_size=self.config.batch_size,
            shuffle=False,
            num_workers=self.config.data_loader_workers,
            sampler=DistributedSampler(dataset)
        )

    def _load_snapshot(self):
        if not os.path.exists(self.config.snapshot_path):
            print("Snapshot not found. Training model from scratch")
            return
        snapshot_data = torch.load(self.config.snapshot_path, map_location="cpu")
        snapshot = Snapshot(**snapshot_data)
        self.model.load_state_dict(snapshot.model_state)
        self.optimizer.load_state_dict(snapshot.optimizer_state)
        self.scheduler.load_state_dict(snapshot.scheduler_state)
        self.epochs_run = snapshot.finished_epoch
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets, train: bool = True) -> float:
        with torch.set_grad_enabled(train):
            _, loss = self.model(source, targets)

        if train:
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_norm_clip)
            self.optimizer.step()

        return loss.item()

    def _run_epoch(self, epoch: int, dataloader: DataLoader, train: bool = True):
        dataloader.sampler.set_epoch(epoch)
        self.model.train(train)
        total_loss, total_count = 0.0, 0
        for iter, (source, targets) in enumerate(dataloader):
            step_type = "Train" if train else "Eval"
            batch_loss = self._run_batch(source, targets, train)
            total_loss += batch_loss * source.size(0)
            total_count += source.size(0)
            if iter % 10 == 0:
                print(f"[GPU{self.global_rank}] Epoch {epoch} | Iter {iter} | {step_type} Loss {batch_loss:.5f}")

        if train:
            self.scheduler.step()
        else:
            stats = torch.tensor([total_loss, total_count], dtype=torch.float64)
            dist.all_reduce(stats, op=dist.ReduceOp.SUM)
            if self.global_rank == 0:
                print(f"[GPU{self.global_rank}] Epoch {epoch} | test loss {(stats[0] / stats[1]).item():.6f}")

    def _save_snapshot(self, epoch):
        # capture snapshot
        model = self.model
        raw_model = model.module if hasattr(model, "module") else model
        snapshot = Snapshot(
            model_state=raw_model.state_dict(),
            optimizer_state=self.optimizer.state_dict(),
            scheduler_state=self.scheduler.state_dict(),
            finished_epoch=epoch
        )
        # save snapshot
        snapshot = asdict(snapshot)
        torch.save(snapshot, self.config.snapshot_path)
        print(f"Snapshot saved at epoch {epoch}")

    def train(self):
        for epoch in range(start_epoch(self.epochs_run), self.config.max_epochs):
            epoch += 1
            self._run_epoch(epoch, self.train_loader)
            if self.local_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)
            # eval run
            if self.test_loader:
                self._run_epoch(epoch, self.test_loader, train=False)


def get_text():
    # plain python source from a few stdlib modules, no downloads
    return "".join(inspect.getsource(m) for m in (textwrap, functools, json.decoder, collections))


def get_train_objs(block_size, n_train, n_test, lr, weight_decay):
    text = get_text()[: n_train + n_test + block_size]
    dataset = CharDataset(text, block_size)
    train_set, test_set = random_split(dataset, [n_train, n_test])
    model = CharMLP(dataset.vocab_size, block_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, Optimizer(optimizer, lr_scheduler=scheduler), scheduler, train_set, test_set


def main():
    torch.manual_seed(0)
    parser = argparse.ArgumentParser(description="minGPT-ddp style CPU training")
    parser.add_argument("--max-epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--save-every", type=int, default=1)
    parser.add_argument("--snapshot-path", type=str, default="snapshot.pt")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-norm-clip", type=float, default=1.0)
    # --- for the tests ---
    parser.add_argument("--final-out", type=str, default=None,
                        help="every rank saves its final state to {PREFIX}_rank{rank}.pt")
    args = parser.parse_args()

    init_process_group(backend="gloo")

    trainer_cfg = TrainerConfig(
        max_epochs=args.max_epochs,
        batch_size=args.batch_size,
        data_loader_workers=0,
        grad_norm_clip=args.grad_norm_clip,
        snapshot_path=args.snapshot_path,
        save_every=args.save_every,
    )
    model, optimizer, scheduler, train_data, test_data = get_train_objs(
        block_size=16, n_train=3000, n_test=300, lr=args.lr, weight_decay=args.weight_decay)
    trainer = Trainer(trainer_cfg, model, optimizer, scheduler, train_data, test_data)
    trainer.train()

    # --- for the tests ---
    if args.final_out:
        rank = dist.get_rank()
        torch.save({
            "model": trainer.model.module.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(),
        }, f"{args.final_out}_rank{rank}.pt")

    destroy_process_group()


if __name__ == "__main__":
    main()
