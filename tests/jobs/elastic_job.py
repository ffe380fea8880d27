"""A data-parallel job for the elastic tests: it logs every sample index it trains on.

Each step, each rank appends one JSON line to OUT/samples/<node id>.jsonl: generation, rank,
world size, step, epoch and the dataset indices of its batch. A step that was rolled back is
done again in a later generation, so a reader keeps, for every step index, the lines of the
newest generation that ran it, and then counts the indices per epoch.

--return-delay S: a restarted incarnation (OUT/started/<node id> exists already) sleeps S
seconds before joining the cluster, so it comes back after the elastic deadline.
--kill-restarted-after K: a restarted incarnation SIGKILLs itself after K steps.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=256)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--return-delay", type=float, default=0.0)
parser.add_argument("--kill-restarted-after", type=int, default=0)
args = parser.parse_args()
out = Path(args.out)

# --- a restarted worker comes back late -------------------------------------------------
node = os.environ.get("TG_NODE_ID", "x")
started = out / "started" / node
started.parent.mkdir(parents=True, exist_ok=True)
restarted = started.exists()
if restarted and args.return_delay:
    print(f"node {node}: restarted; coming back in {args.return_delay:g} s", flush=True)
    time.sleep(args.return_delay)
started.touch()

import trainguard as tg  # noqa: E402  (after the delay: a hot spare has imported it already)

tg.init()
rank = tg.get_rank()
torch.manual_seed(1234)
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
torch.manual_seed(100 + rank)

# --- data: every sample carries its index ------------------------------------------------
gen = torch.Generator().manual_seed(7)
X = torch.randn(args.samples, 8, generator=gen)
y = (X @ torch.randn(8, 3, generator=gen)).argmax(dim=1)
dataset = TensorDataset(X, y, torch.arange(args.samples))

model = tg.DataParallel(net)
opt = torch.optim.SGD(net.parameters(), lr=0.05)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=tg.ShardedSampler(dataset, seed=3))
session = tg.Session(tg.TrainState(model=model, optimizer=opt, loader=loader), tg.SessionConfig(epochs=args.epochs))
log_path = out / "samples" / f"{node}.jsonl"
log_path.parent.mkdir(parents=True, exist_ok=True)
fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

# --- train --------------------------------------------------------------------------------
ran = 0  # steps run by this process
for step in session.steps():
    with step:
        x, t, idx = step.batch
        rt = session.rt
        line = {"node": node, "gen": rt.generation, "rank": rt.rank, "world": rt.world_size, "step": step.index,
                "epoch": step.epoch, "idx": idx.tolist()}
        os.write(fd, (json.dumps(line) + "\n").encode())
        opt.zero_grad()
        F.cross_entropy(model(x), t).backward()
        opt.step()
    time.sleep(args.step_sleep)
    ran += 1
    if restarted and ran == args.kill_restarted_after:
        print(f"node {node}: killing this restarted incarnation after {ran} steps", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

os.close(fd)
print(f"rank {rank} (node {node}): done after {session.step} steps, epoch {session.epoch}, "
      f"world size {tg.get_world_size()}", flush=True)
