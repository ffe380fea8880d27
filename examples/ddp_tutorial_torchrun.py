"""A typical PyTorch DDP tutorial script, in the style of the official multinode tutorial: a Trainer
with an epoch loop and a batch loop, DistributedSampler, its own snapshot save/load, gloo on CPU.
examples/ddp_tutorial_torchrun.py is the original, which imports nothing from trainguard;
examples/ddp_tutorial.py is the same script ported to trainguard (diff the two files).

    torchrun --standalone --nproc-per-node 2 examples/ddp_tutorial_torchrun.py     # the original
    trainguard run --workers 2 examples/ddp_tutorial.py                            # the port
    TG_FAULT=1:40:kill trainguard run --workers 2 examples/ddp_tutorial.py         # kill -9 rank 1 after step 40

Rank 0 prints each epoch's mean loss and time, and saves a snapshot every --save-every epochs;
every rank loads the snapshot at start if it exists.
With --out, rank 0 writes the final model and optimizer state as safetensors.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from digits_data import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def ddp_setup():
    dist.init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print(f"[rank {self.global_rank}] loading snapshot {snapshot_path}", flush=True)
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"[rank {self.global_rank}] resuming training from snapshot at epoch {self.epochs_run}", flush=True)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch):
        start = time.perf_counter()
        self.train_data.sampler.set_epoch(epoch)
        total = 0.0
        for source, targets in self.train_data:
            total += self._run_batch(source, targets)
        if self.global_rank == 0:
            print(f"epoch {epoch} | steps {len(self.train_data)} | mean loss {total / len(self.train_data):.4f} | "
                  f"{1000 * (time.perf_counter() - start):.1f} ms", flush=True)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(snapshot, self.snapshot_path)
        print(f"epoch {epoch} | training snapshot saved at {self.snapshot_path}", flush=True)

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch)

    def save_final(self, path):
        """Model and optimizer state, flattened into one dict of tensors."""
        tensors = {f"model.{k}": v.contiguous() for k, v in self.model.module.state_dict().items()}
        for index, state in self.optimizer.state_dict()["state"].items():
            tensors.update({f"optimizer.{index}.{k}": v.contiguous() for k, v in state.items()
                            if isinstance(v, torch.Tensor)})
        save_file(tensors, path)


def load_train_objs():
    torch.manual_seed(0)
    digits = load_digits()  # 1797 8x8 images, shipped with scikit-learn
    images = torch.tensor(digits.images, dtype=torch.float32).flatten(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_set = TensorDataset(images, labels)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 64), nn.ReLU(),
                          nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset, seed=0))


def main(save_every, total_epochs, batch_size, snapshot_path, out):
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    if out and trainer.global_rank == 0:
        trainer.save_final(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("--total-epochs", type=int, default=8, help="total epochs to train the model")
    parser.add_argument("--save-every", type=int, default=2, help="how often to save a snapshot (epochs)")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size on each rank")
    parser.add_argument("--snapshot-path", default="snapshot.pt")
    parser.add_argument("--out", default="", help="rank 0 writes the final model and optimizer state here")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path, args.out)
