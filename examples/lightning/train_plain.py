"""A plain PyTorch Lightning script, in the shape of Lightning's image-classifier examples: scikit-learn's digits in
a LightningDataModule (random shifts and noise drawn in the training dataset's `__getitem__`), a small CNN with
BatchNorm and dropout, SGD with momentum and a StepLR stepped each epoch (or a OneCycleLR stepped each step),
training and validation with metrics logged across ranks, gradient accumulation, ModelCheckpoint on the validation
loss, a CSV logger and `seed_everything`. `--strategy fsdp` shards the model with FSDP2 in `configure_model()` under
Lightning's ModelParallelStrategy.

    torchrun --nproc-per-node 3 examples/lightning/train_plain.py --devices 3

examples/lightning/train.py is this script under trainguard (2 lines changed).
"""

import argparse

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, Dataset, TensorDataset


class Augmented(Dataset):
    """Training images shifted by up to a pixel and lightly noised, drawn from torch's global generator in
    `__getitem__`, as torchvision's random transforms draw."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        dy, dx = torch.randint(-1, 2, (2,)).tolist()
        image = torch.roll(self.images[i], shifts=(dy, dx), dims=(1, 2))
        return image + 0.05 * torch.randn_like(image), self.labels[i]


class DigitsData(L.LightningDataModule):
    def __init__(self, batch_size: int = 32, num_workers: int = 0):
        super().__init__()
        self.batch_size, self.num_workers = batch_size, num_workers

    def setup(self, stage=None):
        images, labels = load_digits(return_X_y=True)
        images = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        labels = torch.tensor(labels)
        split = int(0.8 * len(images))
        self.train_set = Augmented(images[:split], labels[:split])
        self.val_set = TensorDataset(images[split:], labels[split:])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=2 * self.batch_size)


class Classifier(L.LightningModule):
    def __init__(self, channels: int = 16, lr: float = 0.05, schedule: str = "epoch", fsdp: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.dropout = nn.Dropout(0.25)
        self.fc = nn.Linear(2 * channels * 2 * 2, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(self.dropout(torch.flatten(x, 1)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            metrics = self.trainer.callback_metrics
            self.print(f"epoch {self.current_epoch}: val_loss {metrics['val_loss']:.6f} "
                       f"val_acc {metrics['val_acc']:.6f}")

    def on_train_epoch_end(self):
        self.print(f"epoch {self.current_epoch}: train_loss {self.trainer.callback_metrics['train_loss_epoch']:.6f}")

    def configure_model(self):
        if not self.hparams.fsdp:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in (self.conv1, self.conv2, self.fc):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9, weight_decay=5e-4)
        if self.hparams.schedule == "step":
            steps = self.trainer.estimated_stepping_batches
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr, total_steps=steps)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--grad_accum", type=int, default=1)
    parser.add_argument("--num_workers", type=int, default=0, help="the training loader's worker processes")
    parser.add_argument("--schedule", choices=["epoch", "step"], default="epoch")
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", default="lightning_out")
    parser.add_argument("--ckpt_path", default=None)
    args = parser.parse_args()

    L.seed_everything(args.seed)
    model = Classifier(channels=args.channels, schedule=args.schedule, fsdp=args.strategy == "fsdp")
    if args.strategy == "fsdp":
        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    else:
        strategy = "ddp"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        accumulate_grad_batches=args.grad_accum,
        callbacks=[ModelCheckpoint(dirpath=f"{args.out}/checkpoints", monitor="val_loss", save_last=True),
                   LearningRateMonitor(logging_interval="step")],
        logger=CSVLogger(args.out, name="logs"),
        log_every_n_steps=5,
        enable_progress_bar=False,
    )
    trainer.fit(model, datamodule=DigitsData(args.batch_size, args.num_workers), ckpt_path=args.ckpt_path)


if __name__ == "__main__":
    main()
