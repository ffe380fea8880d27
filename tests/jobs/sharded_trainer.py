"""A hand-written trainer with a sharded model, as a user ports it: `trainguard run --workers N sharded_trainer.py
LAYOUT OUT [--bn] [--epochs E]`.

LAYOUT: `fsdp` (fully_shard over every rank), `hsdp-RxS` (fully_shard on a (replicate, shard) mesh),
`dptp-AxB` (tensor parallel on the "tp" dimension, fully_shard on the "dp" one). The model has dropout,
and with --bn a BatchNorm on its input (plain per-rank buffers); the optimizer is SGD with momentum
and an LR scheduler; the training loader and an eval loader (with a metric all-reduce) come from
scikit-learn's digits; the loop runs over epochs from `trainguard.start_epoch()`. `--sliced DIR`: sliced
checkpoints every 4 steps (`trainguard.ShardedCheckpoints`).

At the end every rank writes OUT/rank<r>.safetensors: its local part of every tensor of the model
(buffers included), the optimizer's state and hyperparameters, and the scheduler's state. Rank 0
appends "step loss" to OUT/losses.txt after every step (a step trained again appends again). Then every
rank prints how many models of this script are alive in the process (1: earlier runs left nothing behind).
"""

import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import TensorDataset

import trainguard as tg

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from digits_data import load_digits  # noqa: E402  (scikit-learn's digits, without its 2 s import)

layout, out = sys.argv[1], sys.argv[2]
bn = "--bn" in sys.argv
epochs = int(sys.argv[sys.argv.index("--epochs") + 1]) if "--epochs" in sys.argv else 2
sliced = sys.argv[sys.argv.index("--sliced") + 1] if "--sliced" in sys.argv else ""


def model_for(layout: str) -> tuple[nn.Module, int, int]:
    """The model, sharded; the data-parallel degree and this rank's data rank."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(64) if bn else nn.Identity(), nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    world, rank = dist.get_world_size(), dist.get_rank()
    kind, _, dims = layout.partition("-")
    shape = tuple(int(d) for d in dims.split("x")) if dims else (world,)
    if kind == "dp":  # data parallelism, for comparison
        return tg.DDP(model), world, rank
    if kind == "fsdp":
        mesh = tg.init_device_mesh("cpu", shape)
        for i in (1, 4):
            tg.fully_shard(model[i], mesh=mesh)
        tg.fully_shard(model, mesh=mesh)
        return model, world, rank
    if kind == "hsdp":
        mesh = tg.init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        tg.fully_shard(model, mesh=mesh)
        return model, world, rank
    mesh = tg.init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    tg.parallelize_module(model, mesh["tp"], {"1": ColwiseParallel(), "4": RowwiseParallel()})
    tg.fully_shard(model, mesh=mesh["dp"])
    return model, shape[0], mesh.get_coordinate()[0]


def main() -> None:
    tg.init()
    model, dp, dp_rank = model_for(layout)
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).flatten(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    train = TensorDataset(x[:1200], y[:1200])
    held = TensorDataset(x[1200:1500], y[1200:1500])
    loader = tg.DataLoader(train, batch_size=48, sampler=tg.DistributedSampler(train, num_replicas=dp, rank=dp_rank))
    eval_loader = tg.DataLoader(held, batch_size=100)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    ckpt = tg.ShardedCheckpoints(sliced, "sliced", every=4) if sliced else None
    optimizer = tg.Optimizer(opt, lr_scheduler=sched, checkpoints=ckpt)
    rank = dist.get_rank()
    for epoch in range(tg.start_epoch(), epochs):
        loader.sampler.set_epoch(epoch)
        model.train()
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
            sched.step()
            if rank == 0:
                with open(os.path.join(out, "losses.txt"), "a") as f:
                    f.write(f"{sched.last_epoch} {loss.item()!r}\n")
        model.eval()
        correct = torch.zeros(1)
        with torch.no_grad():
            for xb, yb in eval_loader:
                correct += (model(xb).argmax(1) == yb).sum()
        dist.all_reduce(correct)
        if rank == 0:
            print(f"epoch {epoch}: held-out accuracy {correct.item() / (len(held) * dist.get_world_size()):.3f}",
                  flush=True)
    write_part(model, opt, sched)
    gc.collect()  # a rewind must leave nothing of the script's earlier runs alive (their models and optimizers)
    alive = sum(1 for o in gc.get_objects() if issubclass(type(o), nn.Sequential))
    print(f"rank {dist.get_rank()}: live models {alive}", flush=True)


def write_part(model, opt, sched) -> None:
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    osd = opt.state_dict()
    state = {"model": {k: local(v) for k, v in model.state_dict().items()},
             "optim": {str(i): {k: local(v) for k, v in s.items()} for i, s in osd["state"].items()},
             "groups": [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]],
             "sched": sched.state_dict()}
    tg.save_state(os.path.join(out, f"rank{dist.get_rank()}.safetensors"), state)


if __name__ == "__main__":
    os.makedirs(out, exist_ok=True)
    main()
