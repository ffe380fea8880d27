r"""A character-level Transformer language model trained with DP x TP, with sliced checkpoints that
resume on another layout (MindSpore's "distributed fault recovery", reference 002).

    trainguard run --workers 4 --hot-spares 0 examples/transformer_tp.py --dp 2 --tp 2 --steps 40 \
        --ckpt-dir ckpt --save-steps 10
    trainguard run --workers 2 --hot-spares 0 examples/transformer_tp.py --dp 1 --tp 2 --steps 60 \
        --ckpt-dir ckpt --save-steps 10 --resume          # goes on from ckpt/transformer-1_40
    python -c "import trainguard as tg; print(tg.restore_group_info_list('ckpt/transformer-1_40', rank=0))"
    # [0, 2]: with dp=2 x tp=2, rank 2 holds the same slices as rank 0 (its replica)

The text is the source of a few standard-library modules, read as bytes (vocabulary 0-255), so
nothing is downloaded. The ranks form a ("dp", "tp") DeviceMesh with tp fastest: ranks (0, 1)
split every attention and MLP projection between them (Colwise q/k/v and fc1, Rowwise out and
fc2; each holds heads // tp heads), and ranks (0, 2) are data-parallel replicas.

The global batch does not depend on the layout: each step is --micro-batches micro-batches,
drawn by a generator seeded with (step, micro-batch index); dp rank r trains micro-batches
r*k .. r*k+k-1 (k = micro-batches // dp), adding up their gradients, and the dp group sums
them. So a resumed run sees the same batches, on any dp. With two micro-batches and the same tp,
dp=2 and dp=1 compute the same sum of two gradients (a + b == b + a), and the loss curve of a
run resumed on (dp=1, tp=2) is bit-identical to that of an uninterrupted (dp=2, tp=2) run.
"""

import argparse
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import trainguard
from trainguard.checkpoint import list_checkpoints, read_manifest
from trainguard.train import parallel_strategy

PREFIX = "transformer"
SOURCES = ("argparse.py", "inspect.py", "typing.py", "dataclasses.py", "functools.py")

# --- arguments -----------------------------------------------------------------
parser = argparse.ArgumentParser()
parser.add_argument("--dp", type=int, default=2, help="data-parallel degree")
parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree; dp x tp must be the world size")
parser.add_argument("--steps", type=int, default=40, help="train until this global step")
parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step, spread over dp")
parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--d-model", type=int, default=64)
parser.add_argument("--heads", type=int, default=4)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--log-every", type=int, default=5)
parser.add_argument("--ckpt-dir", default="", help=f"save checkpoints here as {PREFIX}-1_<step>")
parser.add_argument("--save-steps", type=int, default=10)
parser.add_argument("--integrated", action="store_true", help="save whole tensors (one file) instead of slices")
parser.add_argument("--resume", action="store_true", help="go on from the newest complete checkpoint in --ckpt-dir")
args = parser.parse_args()
for flag in ("dp", "tp", "steps", "micro_batches", "batch_size", "log_every", "save_steps"):
    if getattr(args, flag) < 1:
        parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
if args.heads % args.tp or args.d_model % args.heads:
    parser.error(f"--heads {args.heads} must divide --d-model {args.d_model} and be divisible by --tp {args.tp}")
if args.micro_batches % args.dp:
    parser.error(f"--micro-batches {args.micro_batches} must be divisible by --dp {args.dp}")
if args.resume and not args.ckpt_dir:
    parser.error("--resume needs --ckpt-dir")

# --- cluster: a (dp, tp) mesh, tp fastest --------------------------------------------
trainguard.init()
rank, world = trainguard.get_rank(), trainguard.get_world_size()
if args.dp * args.tp != world:
    raise trainguard.ConfigError(f"--dp {args.dp} x --tp {args.tp} = {args.dp * args.tp}, but the job has {world} "
                                 f"workers; pick dp and tp whose product is {world}")
mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
dp_rank, dp_group = mesh.get_local_rank("dp"), mesh.get_group("dp")
torch.manual_seed(0)

# --- data: standard-library sources as bytes, a fixed 90/10 split ------------------------
lib = os.path.dirname(os.__file__)
text = b"".join(Path(lib, name).read_bytes() for name in SOURCES)
data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
train_data = data[:int(0.9 * len(data))]


def micro_batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch `index` of global step `step`: the same on every layout and every run."""
    g = torch.Generator().manual_seed(1_000_003 * step + index)
    starts = torch.randint(len(train_data) - args.seq_len - 1, (args.batch_size,), generator=g)
    rows = torch.stack([train_data[s:s + args.seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


# --- model: embeddings, transformer blocks, LM head ----------------------------------------
class Attention(nn.Module):
    def __init__(self, d_model: int, heads: int, tp: int):
        super().__init__()
        self.local_heads, self.head_dim = heads // tp, d_model // heads  # after TP each rank holds heads // tp
        self.q, self.k, self.v, self.out = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, self.local_heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, self.local_heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, tp: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = Attention(d_model, heads, tp)
        self.fc1, self.fc2 = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CharLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(256, args.d_model)
        self.pos = nn.Embedding(args.seq_len, args.d_model)
        self.blocks = nn.ModuleList(Block(args.d_model, args.heads, args.tp) for _ in range(args.layers))
        self.ln = nn.LayerNorm(args.d_model)
        self.head = nn.Linear(args.d_model, 256)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


model = CharLM()
plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.out": RowwiseParallel(), "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
for block in model.blocks:
    parallelize_module(block, mesh["tp"], plan)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)


def train_state() -> dict:
    # DTensors are saved as the slices each rank holds; the RNG is unused here (no dropout), but kept
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "rng": torch.get_rng_state()}


def layout_name(doc: dict | None) -> str:
    mesh = (doc or {}).get("mesh") or {}
    return " x ".join(f"{n}={s}" for n, s in zip(mesh.get("dim_names", ()), mesh.get("shape", ()))) or "unknown"


# --- resume from the newest complete checkpoint, saved on any layout ---------------------------
start = 0
found = list_checkpoints(Path(args.ckpt_dir), PREFIX) if args.resume else []
layout = parallel_strategy.describe(model, world, mesh=mesh)
if found:
    previous = parallel_strategy.read(Path(args.ckpt_dir))  # the layout the checkpoints were written with
    if rank == 0 and previous is not None and previous["world_size"] != world:
        print(f"the device count changed ({previous['world_size']} -> {world}): resharding from "
              f"{layout_name(previous)} to {layout_name(layout)}", flush=True)
    folder = found[-1].path
    trainguard.init_optimizer_state(optimizer)  # the optimizer's tensors must exist to be loaded into
    loaded = trainguard.load_sharded(folder, train_state())  # fills this layout's slices in place
    model.load_state_dict(loaded["model"])  # and these restore the rest (AdamW's hyperparameters)
    optimizer.load_state_dict(loaded["optim"])
    torch.set_rng_state(loaded["rng"])
    start = read_manifest(folder)["append_info"]["step"]
    if rank == 0:
        print(f"resumed from {folder} at step {start} on dp={args.dp} x tp={args.tp}", flush=True)
elif args.resume and rank == 0:
    print(f"no complete checkpoint in {args.ckpt_dir}; starting from step 0", flush=True)
if args.ckpt_dir and rank == 0:  # strategy.json: this run's layout, next to the checkpoints it writes
    parallel_strategy.write(layout, [Path(args.ckpt_dir)])


def save(step: int) -> None:
    folder = Path(args.ckpt_dir, f"{PREFIX}-1_{step}")
    if not (folder / "manifest.json").exists():
        trainguard.save_sharded(folder, train_state(), step=step, epoch=1, integrated=args.integrated,
                                append_info={"step": step})


# SIGTERM / SIGINT / SIGUSR1: every rank stops at the same step and saves a dying-gasp checkpoint
stop = trainguard.GracefulStop()

# --- train -----------------------------------------------------------------------------------
per_rank = args.micro_batches // args.dp
for step in range(start + 1, args.steps + 1):
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros(())
    for i in range(per_rank):
        x, y = micro_batch(step, dp_rank * per_rank + i)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()  # gradients of the micro-batches add up in .grad
        loss_sum += loss.detach()
    with torch.no_grad():  # data parallel: sum over the dp group, then the mean over all micro-batches
        for p in model.parameters():
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(grad, group=dp_group)
            grad.div_(args.micro_batches)
        dist.all_reduce(loss_sum, group=dp_group)
    optimizer.step()

    if rank == 0 and step % args.log_every == 0:
        loss = np.float32((loss_sum / args.micro_batches).item())
        print(f"epoch: 1 step: {step}, loss is {str(loss)}", flush=True)
    if args.ckpt_dir and step % args.save_steps == 0:
        save(step)
    if stop.requested(step):  # one all-reduce: some rank was signalled
        stop.exit(step, lambda: save(step) if args.ckpt_dir else None)
