"""A small character-level language model trained the way people write it for torchrun (no trainguard):
a causal transformer with a registered attention-mask buffer, a warmup + cosine LR schedule stepped every
step, gradient clipping, an exponential moving average of the weights (AveragedModel), an eval pass every
epoch whose loss is reduced with all_reduce, and rank 0's own snapshot. The text is the source of Python's
own argparse module (it ships with every Python). examples/lm.py is this script ported to trainguard.

    torchrun --standalone --nproc-per-node 3 examples/lm_torchrun.py --epochs 2
    trainguard run --workers 3 examples/lm.py --epochs 2

Rank 0 prints each epoch's eval loss of the model and of its moving average (exact reprs). With --out DIR
every rank writes its final model, EMA, optimizer and scheduler state to DIR/rank_R.pt.
"""

import argparse
import inspect
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

# --- arguments -------------------------------------------------------------------------------------
parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--context", type=int, default=32)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--samples", type=int, default=1536, help="training windows of the text")
parser.add_argument("--snapshot", default="lm_snapshot.pt")
parser.add_argument("--out", default="")
args = parser.parse_args()

# --- setup ----------------------------------------------------------------------------------------
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)

text = torch.tensor(list(inspect.getsource(argparse).encode()), dtype=torch.int64)
starts = torch.arange(0, len(text) - args.context - 1, (len(text) - args.context - 1) // (args.samples + 256))
windows = torch.stack([text[s:s + args.context + 1] for s in starts])
train_set = TensorDataset(windows[:args.samples])
eval_set = TensorDataset(windows[args.samples:args.samples + 192])
train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=DistributedSampler(train_set, seed=1))
eval_loader = DataLoader(eval_set, batch_size=32, sampler=DistributedSampler(eval_set, shuffle=False))


class CausalLM(nn.Module):
    def __init__(self, vocab=256, dim=64, heads=4, layers=2, context=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, x):
        n = x.shape[1]
        h = self.embed(x) + self.pos[:n]
        return self.head(self.blocks(h, mask=self.mask[:n, :n], is_causal=True))


model = CausalLM(context=args.context)
ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
total = args.epochs * len(train_loader)
warmup = max(1, total // 10)
scheduler = torch.optim.lr_scheduler.LambdaLR(
    optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))

start_epoch = 0
if os.path.exists(args.snapshot):
    snapshot = torch.load(args.snapshot, map_location="cpu", weights_only=True)
    model.load_state_dict(snapshot["model"])
    ema.load_state_dict(snapshot["ema"])
    optimizer.load_state_dict(snapshot["optimizer"])
    scheduler.load_state_dict(snapshot["scheduler"])
    start_epoch = snapshot["epoch"]
model = DDP(model)


# --- evaluation -----------------------------------------------------------------------------------
def evaluate(net):
    net.eval()
    totals = torch.zeros(2, dtype=torch.float64)  # loss sum, tokens
    with torch.no_grad():
        for (w,) in eval_loader:
            logits = net(w[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum")
            totals += torch.tensor([loss.item(), w[:, 1:].numel()], dtype=torch.float64)
    dist.all_reduce(totals)
    net.train()
    return (totals[0] / totals[1]).item()


# --- training -------------------------------------------------------------------------------------
for epoch in range(start_epoch, args.epochs):
    train_loader.sampler.set_epoch(epoch)
    model.train()
    for (w,) in train_loader:
        logits = model(w[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        scheduler.step()
        ema.update_parameters(model.module)
    eval_loss, ema_loss = evaluate(model), evaluate(ema)
    if rank == 0:
        print(f"epoch {epoch} eval_loss {eval_loss!r} ema_loss {ema_loss!r}", flush=True)
        torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch + 1}, args.snapshot)
    dist.barrier()

# --- the end --------------------------------------------------------------------------------------
if args.out:
    os.makedirs(args.out, exist_ok=True)
    torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, os.path.join(args.out, f"rank_{rank}.pt"))
dist.destroy_process_group()
