"""A diffusion-style trainer (the shape of lucidrains' Trainer, as a blind port wrote it): it counts `self.step`
itself, trains `while self.step < self.train_num_steps` over an endless `cycle(dl)`, and resumes from its own
checkpoint (`load(milestone)`: the step, the model, the optimizer) before `self.step = tg.start_step(self.step)`.
Before, the job counted its steps from 0 however far the script's own checkpoint was, so after a fault
`start_step()` handed back the job's count (60 where the script was at 180): exit 0, 60 steps trained twice.

    --steps N          train to step N;  --save FILE   rank 0 saves {step, model, opt} at the end
    --load FILE        resume from such a file (every rank loads it);  --out FILE   rank 0's final state
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import trainguard as tg
from trainguard import DDP, DataLoader, DistributedSampler


def cycle(dl, sampler):
    epoch = tg.start_epoch(0)
    while True:
        sampler.set_epoch(epoch)
        for data in dl:
            yield data
        epoch += 1


class Trainer:
    def __init__(self, args):
        X, _ = load_digits(return_X_y=True)
        ds = TensorDataset(torch.tensor(X, dtype=torch.float32) / 8 - 1)
        self.sampler = DistributedSampler(ds, shuffle=True, seed=0)
        self.model = DDP(nn.Sequential(nn.Linear(65, 64), nn.GroupNorm(4, 64), nn.SiLU(), nn.Dropout(0.1),
                                       nn.Linear(64, 64)))
        self.opt = tg.Optimizer(torch.optim.Adam(self.model.parameters(), lr=1e-3))
        self.dl = DataLoader(ds, batch_size=16, sampler=self.sampler, drop_last=True)
        self.step, self.train_num_steps = 0, args.steps
        if args.load:
            data = torch.load(args.load, weights_only=True)
            self.step = data["step"]
            self.model.module.load_state_dict(data["model"])
            self.opt.load_state_dict(data["opt"])
        self.step = tg.start_step(self.step)
        self.it = cycle(self.dl, self.sampler)

    def train(self):
        while self.step < self.train_num_steps:
            (x,) = next(self.it)
            t = torch.rand(x.shape[0], 1)  # the noise level and the noise, drawn in the loop
            noise = torch.randn_like(x)
            pred = self.model(torch.cat([x * (1 - t) + noise * t, t], 1))
            F.mse_loss(pred, noise).backward()
            self.opt.step()
            self.opt.zero_grad()
            self.step += 1
            if dist.get_rank() == 0 and self.step % 4 == 0:
                print(f"step {self.step}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--load", default="")
    p.add_argument("--save", default="")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    trainer = Trainer(args)
    trainer.train()
    if dist.get_rank() == 0 and args.save:
        torch.save({"step": trainer.step, "model": trainer.model.module.state_dict(),
                    "opt": trainer.opt.state_dict()}, args.save)


if __name__ == "__main__":
    main()
