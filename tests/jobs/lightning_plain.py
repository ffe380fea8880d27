"""A plain PyTorch Lightning script (Trainer with strategy="ddp" on CPU, BatchNorm, dropout, a StepLR, a validation
metric synced across ranks), as tests/test_frameworks.py runs it under `trainguard run`."""

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(-1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)]


if __name__ == "__main__":
    L.seed_everything(0)
    X, y = load_digits(return_X_y=True)
    X, y = torch.tensor(X, dtype=torch.float32) / 16, torch.tensor(y)
    tl = DataLoader(TensorDataset(X[:1400], y[:1400]), batch_size=32, shuffle=True)
    vl = DataLoader(TensorDataset(X[1400:], y[1400:]), batch_size=64)
    L.Trainer(accelerator="cpu", strategy="ddp", max_epochs=2, enable_progress_bar=False).fit(Model(), tl, vl)
