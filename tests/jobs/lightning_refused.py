"""A Lightning script that trainguard's strategy cannot run live, one way per --case: `manual` (manual optimization),
`stream` (a training loader over an IterableDataset without a length). tests/test_lightning.py runs each under
`trainguard run` and expects exit 78 with a message that names the cause and the fix, before any step."""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import trainguard.compat.lightning


class Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(64):
            yield torch.randn(8, generator=g), torch.randint(0, 2, (), generator=g)


class Model(L.LightningModule):
    def __init__(self, manual: bool):
        super().__init__()
        self.net = torch.nn.Linear(8, 2)
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


parser = argparse.ArgumentParser()
parser.add_argument("--case", choices=["manual", "stream"], required=True)
case = parser.parse_args().case
g = torch.Generator().manual_seed(0)
data = Stream() if case == "stream" else TensorDataset(torch.randn(64, 8, generator=g),
                                                       torch.randint(0, 2, (64,), generator=g))
trainer = L.Trainer(accelerator="cpu", strategy=trainguard.compat.lightning.Strategy(), max_epochs=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Model(case == "manual"), DataLoader(data, batch_size=8))
