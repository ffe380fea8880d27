"""A digits classifier written as people write them (BatchNorm, dropout, SGD with momentum, an LR scheduler stepped
per step, an eval pass per epoch, noise drawn in the loop before each forward), its step split into the virtual
shards this rank holds (tests/test_virtual_shards.py). Under `--virtual-shards 12` it must train to the same bits on 2, 3 and 4 workers.

--out DIR: rank 0 writes the final model, optimizer and scheduler state to DIR/final.pt, and each step's
summed loss over the shards (all-reduced in float64: exact for 12 float32 losses of one magnitude) to DIR/losses.jsonl.
--restarted die|wait S: a restarted incarnation (DIR/started/<node id> names another pid) kills itself at once, or comes back
S seconds late: with `--recover-strategy elastic`, the job goes on without it (for good, or until it is back).
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import trainguard as tg

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=4, help="samples a virtual shard trains on each step")
parser.add_argument("--restarted", nargs="+", default=None)
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--no-split", action="store_true", help="one backward on the whole batch: refused")
parser.add_argument("--no-ddp", action="store_true", help="the model left unwrapped (registered): refused")
parser.add_argument("--num-workers", type=int, default=0, help="loader workers; with some, noise is drawn per sample")
args = parser.parse_args()

started = os.path.join(args.out, "started", os.environ.get("TG_NODE_ID", "x"))
os.makedirs(os.path.dirname(started), exist_ok=True)
if os.path.exists(started) and open(started).read() != str(os.getpid()) and args.restarted:  # not a rewind: a new process
    if args.restarted[0] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(args.restarted[1]))
with open(started, "w") as f:
    f.write(str(os.getpid()))

tg.init()
torch.manual_seed(0)
X, y = load_digits(return_X_y=True)
X, y = torch.tensor(X, dtype=torch.float32) / 16.0, torch.tensor(y)
test = TensorDataset(X[480:], y[480:])


class Noisy(torch.utils.data.Dataset):
    """The training digits, each drawn with noise from torch's global generator (as torchvision's random transforms
    draw) when the loader has workers."""

    def __len__(self):
        return 480

    def __getitem__(self, i):
        return X[i] + (0.05 * torch.randn(64) if args.num_workers else 0), y[i]


train = Noisy()

net = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))
model = net if args.no_ddp else tg.DDP(net)
if args.no_ddp:  # held by trainguard, but its gradients are not summed over the shards
    tg.register_state("model", net)
base = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(base, step_size=7, gamma=0.7)
optimizer = tg.Optimizer(base, lr_scheduler=scheduler)
sampler = tg.DistributedSampler(train, shuffle=True, seed=1)
loader = tg.DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers)

for epoch in range(tg.start_epoch(), args.epochs):
    sampler.set_epoch(epoch)
    model.train()
    for x, t in loader:
        optimizer.zero_grad()
        total = torch.zeros((), dtype=torch.float64)
        for xs, ts in ([(x, t)] if args.no_split else tg.micro_batches(x, t)):  # a forward and backward a shard
            xs = xs + 0.01 * torch.randn_like(xs)  # noise drawn in the loop, between the shards' forwards
            loss = F.cross_entropy(model(xs), ts)
            loss.backward()
            total += loss.detach().double()
        dist.all_reduce(total)
        optimizer.step()
        scheduler.step()
        if tg.get_rank() == 0:
            with open(os.path.join(args.out, "losses.jsonl"), "a") as f:
                f.write(json.dumps({"step": scheduler.last_epoch, "loss": total.item(), "t": time.time()}) + "\n")
        time.sleep(args.step_sleep)
    model.eval()
    with torch.no_grad():
        accuracy = (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
    if tg.get_rank() == 0:
        print(f"epoch {epoch}: test accuracy {accuracy:.4f}", flush=True)

if tg.get_rank() == 0:
    os.makedirs(args.out, exist_ok=True)
    torch.save({"model": net.state_dict(), "optimizer": base.state_dict(), "scheduler": scheduler.state_dict()},
               os.path.join(args.out, "final.pt"))
