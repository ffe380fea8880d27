"""A small data-parallel job for checkpoint tests: it logs every step's loss and can slow one save.

Like dp_job.py, each rank consumes Python, NumPy and torch randomness every step, so a wrongly
restored RNG or data position changes the losses. Every executed step appends
{"step", "loss" (float.hex)} to OUT/losses_rank_R.jsonl; a step redone after a rollback appends
again, and the last line of a step wins. At the end each rank writes OUT/rank_R.safetensors.

--kill-in-save RANK:STEP makes that rank SIGKILL itself in the middle of its checkpoint write of
that step: its file is written, its done marker is not.
"""

import argparse
import json
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg
from trainguard.checkpoint import format as fmt
from trainguard.checkpoint import jobsave

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--ckpt", default="")
parser.add_argument("--save-steps", type=int, default=4)
parser.add_argument("--save-seconds", type=float, default=None)
parser.add_argument("--keep", type=int, default=10)
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--kill-in-save", default="", help="RANK:STEP")
args = parser.parse_args()

# --- kill -9 in the middle of a checkpoint write ------------------------------------------
if args.kill_in_save:
    kill_at = tuple(int(v) for v in args.kill_in_save.split(":"))
    real_write = fmt.write_shard

    def write_then_die(path, tensors, *more, **kw):
        out = real_write(path, tensors, *more, **kw)
        if jobsave.WRITING.get() == kill_at:
            print(f"rank {kill_at[0]}: killing myself in the checkpoint write of step {kill_at[1]}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    fmt.write_shard = write_then_die

# --- cluster and per-rank randomness ---------------------------------------------
tg.init()
rank, world = tg.get_rank(), tg.get_world_size()
torch.manual_seed(1234)
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
torch.manual_seed(100 + rank)
np.random.seed(200 + rank)
random.seed(300 + rank)

# --- data: 256 synthetic samples, 3 classes ------------------------------------------
gen = torch.Generator().manual_seed(7)
X = torch.randn(256, 8, generator=gen)
y = (X @ torch.randn(8, 3, generator=gen)).argmax(dim=1)
dataset = TensorDataset(X, y)

# --- training state --------------------------------------------------------------------
opt = torch.optim.Adam(net.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
ckpt = None
if args.ckpt:
    config = tg.CheckpointConfig(save_checkpoint_steps=args.save_steps or None, keep_checkpoint_max=args.keep,
                                 save_checkpoint_seconds=args.save_seconds,
                                 exception_save=True, append_info={"job": "ckpt_job"})
    ckpt = tg.ModelCheckpoint("job", args.ckpt, config)

out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
losses = open(out / f"losses_rank_{rank}.jsonl", "a")


def noisy(x):
    noise = torch.from_numpy(np.random.randn(*x.shape).astype(np.float32))
    return x + 0.01 * noise + random.gauss(0.0, 0.01) + 0.01 * torch.randn_like(x)


# --- train -------------------------------------------------------------------------------
model = tg.DataParallel(net)
loader = DataLoader(dataset, batch_size=16, sampler=tg.ShardedSampler(dataset, seed=1))
state = tg.TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader)
session = tg.Session(state, tg.SessionConfig(epochs=args.epochs), checkpoint=ckpt,
                     callbacks=[ckpt] if ckpt else [])
for step in session.steps():
    with step:
        x, t = step.batch
        opt.zero_grad()
        loss = F.cross_entropy(model(noisy(x)), t)
        loss.backward()
        opt.step()
        sched.step()
    losses.write(json.dumps({"step": step.index, "loss": loss.item().hex()}) + "\n")
    losses.flush()
    time.sleep(args.step_sleep)

# --- the final state of this rank ------------------------------------------------------------
tg.save_state(out / f"rank_{rank}.safetensors", {
    "model": net.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
    "torch_rng": torch.get_rng_state(), "numpy_rng": np.random.get_state()[1], "steps": session.step,
})
print(f"rank {rank}: done after {session.step} steps", flush=True)
