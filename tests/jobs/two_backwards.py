"""Several backwards or updates on one batch, three shapes (3 ranks, a BatchNorm model, trainguard's loader):
- `--mode losses`: two losses from one forward, each backwarded (`retain_graph=True` on the first), one update. The
  first backward's exchange wrote the BatchNorm buffers in place, and the second backward failed ("modified by an
  inplace operation", exit 78), where torch's DDP, which writes them at the forward, trains. Now it trains, exactly.
- `--mode gan`: pytorch/examples' DCGAN loop with both networks in one module under one DDP and one optimizer: the
  discriminator's update, then the generator's, each an `optimizer.step()` on the same batch. A fault between them
  resumed past the batch whose second update never ran (a blind port: exit 0, other weights). Refused at the second
  update, exit 78, naming why.
- `--mode two-ddp`: the same networks each under its own DDP, one optimizer over both: refused where the job
  starts, naming one module under one DDP.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import trainguard as tg
from trainguard import DDP, DataLoader, DistributedSampler


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["losses", "gan", "two-ddp"], default="losses")
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(240, 8), torch.randint(0, 3, (240,)))
    loader = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds))

    if args.mode == "losses":
        model = DDP(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3)))
        optimizer = tg.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        for epoch in range(tg.start_epoch(0), args.epochs):
            loader.sampler.set_epoch(epoch)
            for x, y in loader:
                out = model(x)
                optimizer.zero_grad()
                F.cross_entropy(out, y).backward(retain_graph=True)
                (0.1 * out.pow(2).mean()).backward()
                optimizer.step()
        return

    netG = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh())
    netD = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())
    if args.mode == "two-ddp":
        netG, netD = DDP(netG), DDP(netD)
        gan = None
    else:
        gan = DDP(nn.ModuleDict({"G": netG, "D": netD}))
    params = [{"params": netD.parameters()}, {"params": netG.parameters()}]
    optimizer = tg.Optimizer(torch.optim.Adam(params, lr=2e-4, betas=(0.5, 0.999)))
    for epoch in range(tg.start_epoch(0), args.epochs):
        loader.sampler.set_epoch(epoch)
        for real, _ in loader:
            n = real.size(0)
            optimizer.zero_grad()  # (1) D: real and fake
            fake = (gan.module["G"] if gan else netG)(torch.randn(n, 4))
            err_d = F.binary_cross_entropy(netD(real), torch.ones(n, 1)) + F.binary_cross_entropy(
                netD(fake.detach()), torch.zeros(n, 1))
            err_d.backward()
            optimizer.step()
            optimizer.zero_grad()  # (2) G
            F.binary_cross_entropy(netD(fake), torch.ones(n, 1)).backward()
            optimizer.step()


if __name__ == "__main__":
    main()
