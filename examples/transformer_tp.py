r"""A character-level Transformer language model trained with DP x TP, FSDP2 or HSDP, that survives the
death of any rank live (survivors keep their process) and writes sliced checkpoints that resume on
another layout (MindSpore's "distributed fault recovery", reference 002).

    trainguard run --workers 4 --hot-spares 0 examples/transformer_tp.py --dp 2 --tp 2 --steps 40 \
        --ckpt-dir ckpt --save-steps 10
    trainguard run --workers 2 --hot-spares 0 examples/transformer_tp.py --dp 1 --tp 2 --steps 60 \
        --ckpt-dir ckpt --save-steps 10 --resume          # goes on from ckpt/transformer-1_40
    trainguard run --workers 4 examples/transformer_tp.py --layout fsdp4 --steps 40 --out final.safetensors
    python -c "import trainguard as tg; print(tg.restore_group_info_list('ckpt/transformer-1_40', rank=0))"
    # [0, 2]: with dp=2 x tp=2, rank 2 holds the same slices as rank 0 (its replica)

--layout picks the mesh: dpAxtpB (a ("dp", "tp") mesh, tp fastest: ranks (0, 1) split every
attention and MLP projection between them (Colwise q/k/v and fc1, Rowwise out and fc2; each holds
heads // tp heads), and ranks (0, 2) are data-parallel replicas), fsdpN (fully_shard over N ranks:
no replica) or hsdpRxS (fully_shard on a (replicate, shard) mesh).

It is a plain torch.distributed script; the 8 lines marked `# trainguard` are the port. The model and
optimizer are built once, in the script's own loop; a killed rank is replaced, and every rank goes
back to the committed step (the survivors run the script again in their processes and keep their
shards; the replacement takes its shard from a live replica, else from the in-memory copy its buddy
holds, else from the newest sliced checkpoint), and the result is bit-identical to an uninterrupted
run. `trainguard.ShardedCheckpoints` saves every --save-steps steps and at a stop (SIGTERM: every rank
stops at one step, saves, exits 75); a run started with --resume goes on from the newest one on
whatever layout it now has, resharding the slices.

The text is the source of a few standard-library modules, read as bytes (vocabulary 0-255), so
nothing is downloaded. The global batch does not depend on the layout: each step is
--micro-batches micro-batches, drawn by a generator seeded with (step, micro-batch index); data
rank r trains micro-batches r*k .. r*k+k-1 (k = micro-batches // data ranks), adding up their
gradients, and the data-parallel group sums them. So a resumed run sees the same batches, on any
dp. With two micro-batches and the same tp, dp=2 and dp=1 compute the same sum of two gradients
(a + b == b + a), and the loss curve of a run resumed on (dp=1, tp=2) is bit-identical to that of
an uninterrupted (dp=2, tp=2) run.

--out FILE: at the end rank 0 writes the final model and optimizer state as whole tensors
(trainguard.save_state: safetensors, no pickle), so that runs on any layout can be compared.
"""

import argparse
import os
import re
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import trainguard  # trainguard
from trainguard import fully_shard, init_device_mesh, parallelize_module  # trainguard: were torch's

warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # the LM head's output is a view; no in-place op follows
PREFIX = "transformer"
SOURCES = ("argparse.py", "inspect.py", "typing.py", "dataclasses.py", "functools.py")

# --- arguments -----------------------------------------------------------------
parser = argparse.ArgumentParser()
parser.add_argument("--dp", type=int, default=2, help="data-parallel degree (the layout dp<dp>xtp<tp>)")
parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree; dp x tp must be the world size")
parser.add_argument("--layout", default="", help="dpAxtpB, fsdpN or hsdpRxS (instead of --dp/--tp)")
parser.add_argument("--steps", type=int, default=40, help="train until this global step")
parser.add_argument("--micro-batches", type=int, default=0,
                    help="micro-batches per step, spread over the data ranks (default: 2 for dp x tp, else one per "
                         "data rank)")
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
parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the model lives (cuda: every process on its local GPU, or sharing one)")
parser.add_argument("--out", default="", help="rank 0 writes the final model and optimizer state here")
args = parser.parse_args()
for flag in ("dp", "tp", "steps", "batch_size", "log_every", "save_steps"):
    if getattr(args, flag) < 1:
        parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
if args.resume and not args.ckpt_dir:
    parser.error("--resume needs --ckpt-dir")

match = re.fullmatch(r"dp(\d+)xtp(\d+)|fsdp(\d+)|hsdp(\d+)x(\d+)", args.layout or f"dp{args.dp}xtp{args.tp}")
if not match or not all(int(g) >= 1 for g in match.groups() if g is not None):
    parser.error(f"--layout {args.layout!r}: use dpAxtpB, fsdpN or hsdpRxS with degrees >= 1, e.g. dp2xtp2")
dp_, tp_, fsdp_, rep_, shard_ = (int(g) if g else 0 for g in match.groups())
if dp_:
    KIND, TP, DATA, SHAPE, NAMES = "dpxtp", tp_, dp_, (dp_, tp_), ("dp", "tp")
elif fsdp_:
    KIND, TP, DATA, SHAPE, NAMES = "fsdp", 1, fsdp_, (fsdp_,), ("fsdp",)
else:
    KIND, TP, DATA, SHAPE, NAMES = "hsdp", 1, rep_ * shard_, (rep_, shard_), ("replicate", "shard")
MICRO = args.micro_batches or (2 if KIND == "dpxtp" else DATA)
if MICRO % DATA or (KIND != "dpxtp" and MICRO != DATA):
    parser.error(f"--micro-batches {MICRO}: must be a multiple of the {DATA} data ranks (with FSDP: one per data "
                 "rank)")
if args.heads % TP or args.d_model % args.heads:
    parser.error(f"--heads {args.heads} must divide --d-model {args.d_model} and be divisible by tp={TP}")

trainguard.init()  # trainguard: was dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if world != int(np.prod(SHAPE)):
    parser.error(f"the layout {args.layout or f'dp{args.dp}xtp{args.tp}'} needs {int(np.prod(SHAPE))} processes, "
                 f"not {world}")
torch.manual_seed(0)  # the job's seed (under trainguard every step re-seeds from it, the rank and the step)

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
        self.blocks = nn.ModuleList(Block(args.d_model, args.heads, TP) for _ in range(args.layers))
        self.ln = nn.LayerNorm(args.d_model)
        self.head = nn.Linear(args.d_model, 256)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# --- the job: the mesh, the sharded model, sliced checkpoints ----------------------------------
mesh = init_device_mesh(args.device, SHAPE, mesh_dim_names=NAMES)
torch.manual_seed(0)
model = CharLM().to(args.device)  # initialised on the CPU: the same values on every device
if KIND == "dpxtp":
    parallelize_module(model, mesh["tp"], {f"blocks.*.{name}": style for name, style in (
        ("attn.q", ColwiseParallel()), ("attn.k", ColwiseParallel()), ("attn.v", ColwiseParallel()),
        ("attn.out", RowwiseParallel()), ("fc1", ColwiseParallel()), ("fc2", RowwiseParallel()))})
else:
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
saves = dict(every=args.save_steps, integrated=args.integrated, resume=args.resume)  # trainguard: sliced checkpoints
ckpt = trainguard.ShardedCheckpoints(args.ckpt_dir, PREFIX, **saves) if args.ckpt_dir else None  # trainguard
optimizer = trainguard.Optimizer(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01), checkpoints=ckpt)  # trainguard
start = trainguard.start_step()  # trainguard: where the job is (0, a checkpoint, the committed step after a fault)
if rank == 0:
    where = f"dp={DATA} x tp={TP}" if KIND == "dpxtp" else " x ".join(f"{n}={s}" for n, s in zip(NAMES, SHAPE))
    print(f"training steps {start + 1}..{args.steps} on {where}", flush=True)

# --- train -----------------------------------------------------------------------------------
per_rank = MICRO // DATA
data_rank = mesh.get_local_rank("dp") if KIND == "dpxtp" else rank
data_group = mesh.get_group("dp") if KIND == "dpxtp" else None
for number in range(start + 1, args.steps + 1):
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), device=args.device)
    for i in range(per_rank):
        x, y = (t.to(args.device) for t in micro_batch(number, data_rank * per_rank + i))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()  # gradients of the micro-batches add up in .grad (FSDP: averaged over the mesh)
        loss_sum += loss.detach()
    with torch.no_grad():
        if KIND == "dpxtp":  # data parallel: sum over the dp group, then the mean over all micro-batches
            for p in model.parameters():
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(grad, group=data_group)
                grad.div_(MICRO)
        dist.all_reduce(loss_sum, group=data_group)
    optimizer.step()
    if rank == 0 and number % args.log_every == 0:
        loss = np.float32((loss_sum / MICRO).item())
        print(f"epoch: 1 step: {number}, loss is {str(loss)}", flush=True)


def whole(v):
    """A tensor whole and on the host (a DTensor is gathered: a collective, so every rank calls it)."""
    return (v.full_tensor() if isinstance(v, DTensor) else v).cpu() if isinstance(v, torch.Tensor) else v


if args.out:  # whole tensors, gathered by every rank, written by rank 0
    final = {"model": {k: whole(v) for k, v in model.state_dict().items()},
             "optim": {str(i): {k: whole(v) for k, v in s.items()}
                       for i, s in optimizer.state_dict()["state"].items()}}
    if rank == 0:
        trainguard.save_state(args.out, final)  # trainguard: safetensors of nested dicts, for comparing runs
