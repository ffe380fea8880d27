"""MoCo v2 in small (facebookresearch/moco's builder.py and main_moco.py), the shape a blind helper ported from the docs:
a query encoder and a key encoder copied from it (`requires_grad = False`), the key encoder moved by momentum in the
forward (`param_k.data = param_k.data * m + param_q.data * (1 - m)`, under no_grad, before the step's first
collective), a queue of keys kept as buffers and filled from an all_gather of every rank's keys, shuffle BN (a
permutation drawn on rank 0 and broadcast), two augmented views drawn in `__getitem__`, SGD with momentum, a cosine
LR set by hand at each epoch's start.

Before, a kill -9 anywhere but in the first step exited 0 with other weights: a step cut short put back the buffers
its forward moved, not the frozen parameters, and the momentum update ran twice (train/state/buffers.py:
`moving_frozen`).

--out FILE: rank 0 saves the model and the optimizer.
"""

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

import trainguard as tg
from trainguard import DDP, DataLoader, DistributedSampler

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from digits_data import load_digits  # noqa: E402  (scikit-learn's digits, without its 2 s import)


def encoder(dim):
    return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, dim))


@torch.no_grad()
def concat_all_gather(tensor):
    gathered = [torch.ones_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor, async_op=False)
    return torch.cat(gathered, dim=0)


class MoCo(nn.Module):
    def __init__(self, dim=16, K=48, m=0.99, T=0.2):
        super().__init__()
        self.K, self.m, self.T = K, m, T
        self.encoder_q, self.encoder_k = encoder(dim), encoder(dim)
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data.copy_(param_q.data)
            param_k.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(dim, K), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self):
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data = param_k.data * self.m + param_q.data * (1.0 - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        keys = concat_all_gather(keys)
        ptr = int(self.queue_ptr)
        self.queue[:, ptr:ptr + keys.shape[0]] = keys.T
        self.queue_ptr[0] = (ptr + keys.shape[0]) % self.K

    @torch.no_grad()
    def _batch_shuffle_ddp(self, x):
        x_gather = concat_all_gather(x)
        idx_shuffle = torch.randperm(x_gather.shape[0])
        dist.broadcast(idx_shuffle, src=0)
        idx_unshuffle = torch.argsort(idx_shuffle)
        n = x.shape[0]
        return x_gather[idx_shuffle.view(dist.get_world_size(), -1)[dist.get_rank()]], idx_unshuffle, n

    def forward(self, im_q, im_k):
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            self._momentum_update_key_encoder()
            im_k, idx_unshuffle, n = self._batch_shuffle_ddp(im_k)
            k = F.normalize(self.encoder_k(im_k), dim=1)
            k = concat_all_gather(k)[idx_unshuffle.view(dist.get_world_size(), -1)[dist.get_rank()]]
        l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", [q, self.queue.clone().detach()])
        logits = torch.cat([l_pos, l_neg], dim=1) / self.T
        labels = torch.zeros(logits.shape[0], dtype=torch.long)
        self._dequeue_and_enqueue(k)
        return logits, labels


class TwoCrops(Dataset):
    def __init__(self, x):
        self.x = x

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        return x + 0.1 * torch.randn_like(x), x * (torch.rand_like(x) > 0.2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--out", default="")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    X, _ = load_digits(return_X_y=True)
    ds = TwoCrops(torch.tensor(X[:576], dtype=torch.float32) / 16.0)
    sampler = DistributedSampler(ds)
    loader = DataLoader(ds, batch_size=16, sampler=sampler, drop_last=True)  # 12 steps an epoch on 3 ranks

    model = DDP(MoCo())
    optimizer = tg.Optimizer(torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4))
    criterion = nn.CrossEntropyLoss()
    for epoch in range(tg.start_epoch(0), args.epochs):
        sampler.set_epoch(epoch)
        lr = args.lr * 0.5 * (1.0 + math.cos(math.pi * epoch / args.epochs))  # adjust_learning_rate, --cos
        for group in optimizer.param_groups:
            group["lr"] = lr
        model.train()
        for i, (im_q, im_k) in enumerate(loader):
            output, target = model(im_q, im_k)
            loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if i % 4 == 0 and dist.get_rank() == 0:
                print(f"epoch {epoch} [{i}/{len(loader)}] loss {loss.item():.4f}", flush=True)
    if dist.get_rank() == 0 and args.out:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, args.out)


if __name__ == "__main__":
    main()
