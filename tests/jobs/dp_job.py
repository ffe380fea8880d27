"""A small data-parallel job for recovery tests, at the low level (Session) or high level (Model).

Each rank seeds its RNGs differently and consumes Python, NumPy and torch randomness every
step (noise on the inputs, dropout), so a wrongly restored RNG or data position shows up as
different final weights. At the end each rank writes its whole state to OUT/rank_R.safetensors.
"""

import argparse
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--level", choices=["low", "high"], default="low")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--ckpt", default="")
parser.add_argument("--save-steps", type=int, default=4)
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--dying-gasp", choices=["none", "config", "callback"], default="none",
                    help="config: CheckpointConfig(exception_save=True); callback: also an ExceptionCheckpoint")
parser.add_argument("--progress", choices=["auto", "on", "off"], default="auto", help="Model.train's progress bar")
parser.add_argument("--retriable-at", default="", help="RANK:STEP: raise tg.Retriable once inside that step")
parser.add_argument("--hold-until", default="", help="after training, wait (at most 300 s) until this file exists: "
                    "a test reads the running job (status, metrics) and then lets it end")
parser.add_argument("--restart-delay", type=float, default=0.0,
                    help="a restarted worker waits this long before it joins: a cold restart slower than an elastic "
                         "deadline, whatever the machine (the zygote makes a real one fast)")
args = parser.parse_args()
if args.restart_delay:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    mark = Path(args.out) / f".started_{os.environ['TG_NODE_ID']}"
    if mark.exists():
        time.sleep(args.restart_delay)
    mark.touch()

# --- cluster and per-rank randomness ---------------------------------------------
tg.init()
rank, world = tg.get_rank(), tg.get_world_size()
torch.manual_seed(1234)  # identical model init everywhere (DDP broadcasts rank 0's anyway)
net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
torch.manual_seed(100 + rank)
np.random.seed(200 + rank)
random.seed(300 + rank)

# --- data: 512 synthetic samples, 4 classes ------------------------------------------
gen = torch.Generator().manual_seed(7)
X = torch.randn(512, 16, generator=gen)
y = (X @ torch.randn(16, 4, generator=gen)).argmax(dim=1)
dataset = TensorDataset(X, y)

# --- training state --------------------------------------------------------------------
opt = torch.optim.Adam(net.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
callbacks = []
ckpt = None
if args.ckpt:
    config = tg.CheckpointConfig(save_checkpoint_steps=args.save_steps, keep_checkpoint_max=3,
                                 exception_save=args.dying_gasp == "config")
    ckpt = tg.ModelCheckpoint("job", args.ckpt, config)
    callbacks.append(ckpt)
    if args.dying_gasp == "callback":
        callbacks.append(tg.ExceptionCheckpoint("job", args.ckpt, config))
retriable_at = tuple(int(v) for v in args.retriable_at.split(":")) if args.retriable_at else None


def noisy(x):
    noise = torch.from_numpy(np.random.randn(*x.shape).astype(np.float32))
    return x + 0.01 * noise + random.gauss(0.0, 0.01) + 0.01 * torch.randn_like(x)


# --- train -------------------------------------------------------------------------------
if args.level == "low":
    model = tg.DataParallel(net)
    loader = DataLoader(dataset, batch_size=16, sampler=tg.ShardedSampler(dataset, seed=1))
    state = tg.TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader)
    session = tg.Session(state, tg.SessionConfig(epochs=args.epochs), checkpoint=ckpt, callbacks=callbacks)
    for step in session.steps():
        with step:
            if retriable_at == (rank, step.index):
                retriable_at = None  # once: the redone step goes through
                raise tg.Retriable(f"injected retriable fault in step {step.index} on rank {rank}")
            x, t = step.batch
            opt.zero_grad()
            loss = F.cross_entropy(model(noisy(x)), t)
            loss.backward()
            opt.step()
            sched.step()
        time.sleep(args.step_sleep)
    steps_done = session.step
else:
    class Noisy(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            if args.step_sleep:
                time.sleep(args.step_sleep)
            return self.inner(noisy(x))

    net = Noisy(net)
    model = tg.Model(net, nn.CrossEntropyLoss(), opt, scheduler=sched)
    session = model.train(args.epochs, dataset, callbacks=callbacks, batch_size=16, seed=1,
                          progress={"auto": None, "on": True, "off": False}[args.progress])
    steps_done = session.step

if args.hold_until:
    deadline = time.monotonic() + 300
    while not Path(args.hold_until).exists() and time.monotonic() < deadline:
        time.sleep(0.1)

# --- the final state of this rank ------------------------------------------------------------
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
tg.save_state(out / f"rank_{rank}.safetensors", {
    "model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
    "torch_rng": torch.get_rng_state(), "numpy_rng": np.random.get_state()[1], "steps": steps_done,
})
print(f"rank {rank}: done after {steps_done} steps", flush=True)
