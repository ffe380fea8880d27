r"""A character-level Transformer trained with pipeline parallelism (torch.distributed.pipelining), alone or
with data parallelism (DP x PP): a plain torchrun script, the original of examples/pipeline.py.

    torchrun --standalone --nproc-per-node 2 examples/pipeline_torchrun.py --pp 2 --steps 40
    torchrun --standalone --nproc-per-node 4 examples/pipeline_torchrun.py --pp 2 --dp 2 --schedule 1f1b

The model is built whole with one seed on every rank, and each pipeline stage keeps its layers (the
tutorial's way: the other stages' layers deleted). Ranks form a ("dp", "pp") mesh, pp fastest: ranks
(0, 1) are one pipeline, (2, 3) another. With --dp > 1 each pipeline trains its share of the step's
micro-batches, and the stage's gradients are averaged over its data-parallel peers before the update.
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

parser = argparse.ArgumentParser()
parser.add_argument("--pp", type=int, default=2, help="pipeline stages")
parser.add_argument("--dp", type=int, default=1, help="data-parallel pipelines")
parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
parser.add_argument("--fsdp", action="store_true", help="shard each stage over its data-parallel peers (FSDP2) "
                    "instead of averaging its gradients with all_reduce")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--micro-batches", type=int, default=4, help="per pipeline and step")
parser.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch")
parser.add_argument("--seq-len", type=int, default=32)
parser.add_argument("--d-model", type=int, default=64)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--log-every", type=int, default=10)
parser.add_argument("--out", default="", help="each stage writes its final model and optimizer here as stage<i>.pt")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if world != args.pp * args.dp:
    parser.error(f"--pp {args.pp} x --dp {args.dp} needs {args.pp * args.dp} processes, not {world}")
mesh = init_device_mesh("cpu", (args.dp, args.pp), mesh_dim_names=("dp", "pp"))
stage_index, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")

text = b"".join(Path(os.path.dirname(os.__file__), name).read_bytes() for name in ("argparse.py", "inspect.py"))
data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def get_batch(step):
    """This pipeline's share of the step's sequences (the same on every stage of it)."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(len(data) - args.seq_len - 1, (args.dp, args.micro_batches * args.batch_size), generator=g)
    rows = torch.stack([data[s:s + args.seq_len + 1] for s in starts[dp_rank].tolist()])
    return rows[:, :-1], rows[:, 1:]


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1))
        self.register_buffer("mask", torch.triu(torch.ones(args.seq_len, args.seq_len, dtype=torch.bool), 1))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(256, args.d_model)
        self.pos = nn.Embedding(args.seq_len, args.d_model)
        self.layers = nn.ModuleDict({str(i): Block(args.d_model) for i in range(args.layers)})
        self.norm = nn.LayerNorm(args.d_model)
        self.head = nn.Linear(args.d_model, 256)

    def forward(self, x):
        if self.tok is not None:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for layer in self.layers.values():
            x = layer(x)
        return self.head(self.norm(x)) if self.head is not None else x


torch.manual_seed(0)
model = Transformer()
per_stage = args.layers // args.pp
for i in range(args.layers):  # keep this stage's layers
    if i // per_stage != stage_index:
        del model.layers[str(i)]
if stage_index != 0:
    model.tok = model.pos = None
if stage_index != args.pp - 1:
    model.norm = model.head = None

if args.fsdp:  # PP x FSDP2, as torchtitan builds it: each stage fully sharded over the dp dimension
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
stage = PipelineStage(model, stage_index, args.pp, torch.device("cpu"), group=mesh.get_group("pp"))


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


Schedule = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
schedule = Schedule(stage, args.micro_batches, loss_fn=loss_fn)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
last = stage_index == args.pp - 1
for step in range(args.steps):
    x, y = get_batch(step)
    optimizer.zero_grad()
    losses = []
    inputs = (x,) if stage_index == 0 else ()  # the first stage takes the batch, the last the targets
    if last:
        schedule.step(*inputs, target=y, losses=losses)
    else:
        schedule.step(*inputs)
    if args.dp > 1 and not args.fsdp:  # average the stage's gradients over its data-parallel peers
        for p in model.parameters():
            dist.all_reduce(p.grad, group=mesh.get_group("dp"))
            p.grad /= args.dp
    optimizer.step()
    scheduler.step()
    if last and dp_rank == 0 and (step + 1) % args.log_every == 0:
        print(f"step {step + 1}: loss {torch.stack(losses).mean().item():.4f}", flush=True)

if args.out:  # whole tensors (FSDP2's gathered over the stage's data-parallel ranks), written by dp rank 0
    os.makedirs(args.out, exist_ok=True)
    whole = lambda d: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in d.items()}  # noqa: E731
    optim = optimizer.state_dict()
    state = {"model": whole(model.state_dict()), "optim": {**optim, "state": {i: whole(s) for i, s in optim["state"].items()}}}
    if dp_rank == 0:
        torch.save(state, os.path.join(args.out, f"stage{stage_index}.pt"))
dist.destroy_process_group()
