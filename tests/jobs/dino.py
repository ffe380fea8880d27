"""DINO's shape in small (facebookresearch/dino main_dino.py): a student in DDP, a teacher copied from it before and
updated from it by EMA after every update (not wrapped, no gradients), and DINOLoss with a `center` buffer moved in its
forward from an all_reduce of the teacher's outputs; two noisy views of each digit drawn in `__getitem__`. Neither
the teacher nor the loss is part of the held model: unregistered, a fault brings them back as the script builds them
(exit 0, other weights), which rank 0 now says at the run's start (train/engine/unheld.py). `--register` gives both
to `register_state`, as the message says: bit-identical.
"""
import argparse
import copy

import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import Dataset
import trainguard as tg
from trainguard import DDP, DataLoader, DistributedSampler

class Crops(Dataset):
    def __init__(self):
        X, _ = load_digits(return_X_y=True); self.x = torch.tensor(X, dtype=torch.float32) / 16
    def __len__(self): return len(self.x)
    def __getitem__(self, i):
        x = self.x[i]
        return [x + 0.1 * torch.randn_like(x) for _ in range(2)]

class DINOLoss(nn.Module):
    def __init__(self, out_dim, momentum=0.9):
        super().__init__(); self.m = momentum
        self.register_buffer("center", torch.zeros(1, out_dim))
    def forward(self, s, t, temp=0.04):
        t_out = F.softmax((t - self.center) / temp, dim=-1).detach().chunk(2)
        s_out = (s / 0.1).chunk(2)
        loss = sum(torch.sum(-q * F.log_softmax(s_out[1 - i], dim=-1), dim=-1).mean() for i, q in enumerate(t_out)) / 2
        self.update_center(t)
        return loss
    @torch.no_grad()
    def update_center(self, t):
        c = torch.sum(t, dim=0, keepdim=True); dist.all_reduce(c)
        c = c / (len(t) * dist.get_world_size())
        self.center = self.center * self.m + c * (1 - self.m)

p = argparse.ArgumentParser()
p.add_argument("--register", action="store_true")
p.add_argument("--epochs", type=int, default=2)
args = p.parse_args()
dist.init_process_group("gloo")
torch.manual_seed(0)
ds = Crops()
student = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
teacher = copy.deepcopy(student)
for p in teacher.parameters(): p.requires_grad = False
student = DDP(student)
loss_fn = DINOLoss(32)
opt = tg.Optimizer(torch.optim.AdamW(student.parameters(), lr=1e-3))
if args.register:
    tg.register_state("teacher", teacher)
    tg.register_state("dino_loss", loss_fn)
loader = DataLoader(ds, batch_size=32, sampler=DistributedSampler(ds), drop_last=True)
for epoch in range(tg.start_epoch(0), args.epochs):
    loader.sampler.set_epoch(epoch)
    for it, crops in enumerate(loader):
        x = torch.cat(crops)
        with torch.no_grad():
            t = teacher(x)
        loss = loss_fn(student(x), t)
        opt.zero_grad(); loss.backward(); opt.step()
        with torch.no_grad():
            for ps, pt in zip(student.module.parameters(), teacher.parameters()):
                pt.mul_(0.99).add_((1 - 0.99) * ps.detach())
