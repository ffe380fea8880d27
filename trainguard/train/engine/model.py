"""The high level, in the seeds' style: Model(net, loss_fn, optimizer).train(epochs, dataset, callbacks).

Built on Session: data-parallel (DDP with gradient mean, parameters broadcast from rank 0 at
start), resumable sharded data, in-memory snapshots every step, and recovery from any failure.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

from ..data.sampler import ShardedSampler
from ..parallel.ddp import DataParallel
from ..state.checkpointing import ModelCheckpoint
from ..state.train_state import TrainState
from .progress import ProgressBar, wants_bar
from .session import Session, SessionConfig


class Model:
    def __init__(self, network: torch.nn.Module, loss_fn, optimizer: torch.optim.Optimizer, *, scheduler=None):
        self.network = network
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.scheduler = scheduler  # stepped after every optimizer step
        self.parallel = network if isinstance(network, DataParallel) else DataParallel(network)
        self.session: Session | None = None

    def _loader(self, dataset, batch_size: int | None, shuffle: bool, seed: int) -> DataLoader:
        if isinstance(dataset, DataLoader):
            return dataset
        if batch_size is None:
            raise ValueError("give batch_size= when passing a Dataset (or pass a DataLoader with a ShardedSampler)")
        return DataLoader(dataset, batch_size=batch_size, sampler=ShardedSampler(dataset, shuffle=shuffle, seed=seed),
                          drop_last=True)

    def train(self, epoch: int, train_dataset: Dataset | DataLoader, callbacks=(), *, batch_size: int | None = None,
              shuffle: bool = True, seed: int = 0, snapshot_every: int = 1, retriable=(),
              progress: bool | None = None) -> Session:
        """`progress`: a bar on rank 0's stderr (train/engine/progress.py); None: when stderr is a terminal."""
        loader = self._loader(train_dataset, batch_size, shuffle, seed)
        state = TrainState(model=self.parallel, optimizer=self.optimizer, scheduler=self.scheduler, loader=loader)
        disk = next((cb for cb in callbacks if isinstance(cb, ModelCheckpoint)), None)
        session = Session(state, SessionConfig(epochs=epoch, snapshot_every=snapshot_every, retriable=retriable),
                          checkpoint=disk, callbacks=callbacks)
        self.session = session
        if wants_bar(progress, session.rt.rank):
            callbacks = (*callbacks, ProgressBar(session.total_steps))
            session.callbacks.append(callbacks[-1])
        for cb in callbacks:
            if hasattr(cb, "on_train_begin"):
                cb.on_train_begin(session)
        net, opt = self.parallel, self.optimizer
        net.train()
        for step in session.steps():
            with step:
                x, y = step.batch
                opt.zero_grad(set_to_none=True)
                loss = self.loss_fn(net(x), y)
                loss.backward()
                opt.step()
                if self.scheduler is not None:
                    self.scheduler.step()
                session.last_loss = loss.detach()
                session.last_step = step
        for cb in callbacks:
            if hasattr(cb, "on_train_end"):
                cb.on_train_end(session)
        return session

    @torch.no_grad()
    def eval(self, dataset: Dataset, batch_size: int = 256) -> dict:
        """Accuracy of the wrapped network on `dataset` (computed locally on every rank)."""
        self.network.eval()
        correct = total = 0
        for x, y in DataLoader(dataset, batch_size=batch_size):
            correct += int((self.network(x).argmax(dim=1) == y).sum())
            total += len(y)
        self.network.train()
        return {"accuracy": correct / max(total, 1)}
