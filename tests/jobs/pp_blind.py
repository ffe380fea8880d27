"""Minimal pipeline-parallel training of a byte-level decoder-only transformer.

(tests/test_pipeline.py: pp_blind_torchrun.py, written by a helper that never saw trainguard, ported as a user
would in 6 lines: the imports, init, the optimizer's wrapper and the loop's start. Its batches come from a
torch.Generator of its own, drawn at the top of every step, the same on both stages.)

Follows the manual-split style of the torch.distributed.pipelining tutorial:
build the full model on every rank with the same seed, delete the parts that
do not belong to this rank's stage, wrap the remainder in a PipelineStage and
drive it with a stock schedule (GPipe or 1F1B).

Launch (CPU / gloo, 2 stages):
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 train_pp.py --steps 30
"""

import argparse
import inspect
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

import trainguard as tg
from trainguard import PipelineStage


# --------------------------------------------------------------------------- #
# Model
# --------------------------------------------------------------------------- #
class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads, dropout):
        super().__init__()
        assert d_model % n_heads == 0
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        k = k.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        v = v.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v,
            dropout_p=self.attn_dropout if self.training else 0.0,
            is_causal=True,
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(y))


class Block(nn.Module):
    def __init__(self, d_model, n_heads, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class Transformer(nn.Module):
    """Decoder-only LM whose pieces can be set to None for pipeline splitting.

    Layers live in a ModuleDict (not a ModuleList) so that deleting layers keeps
    the original fully-qualified parameter names ("layers.3.attn...") on every
    stage, which makes per-stage checkpoints easy to stitch back together.
    """

    def __init__(self, vocab_size, block_size, d_model, n_layers, n_heads, dropout):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleDict(
            {str(i): Block(d_model, n_heads, dropout) for i in range(n_layers)}
        )
        self.norm = nn.LayerNorm(d_model)
        # No weight tying: the embedding and the head end up on different stages.
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, x):
        # Stage 0 receives token ids (B, T); later stages receive hidden states.
        if self.tok_emb is not None:
            T = x.size(1)
            pos = torch.arange(T, device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
        return x


def build_stage_module(args, stage_idx, num_stages, vocab_size):
    # Same seed on every rank -> identical full model; each rank then keeps its slice.
    torch.manual_seed(args.seed)
    model = Transformer(
        vocab_size=vocab_size,
        block_size=args.block_size,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        dropout=args.dropout,
    )
    per_stage = math.ceil(args.n_layers / num_stages)
    keep = range(stage_idx * per_stage, min((stage_idx + 1) * per_stage, args.n_layers))
    for i in range(args.n_layers):
        if i not in keep:
            del model.layers[str(i)]
    if stage_idx != 0:
        model.tok_emb = None
        model.pos_emb = None
    if stage_idx != num_stages - 1:
        model.norm = None
        model.lm_head = None
    return model


# --------------------------------------------------------------------------- #
# Data: raw bytes of some stdlib modules
# --------------------------------------------------------------------------- #
def load_corpus():
    import argparse as m1, collections as m2, inspect as m3, json.decoder as m4, textwrap as m5
    chunks = []
    for mod in (m1, m2, m3, m4, m5):
        with open(inspect.getsourcefile(mod), "rb") as f:
            chunks.append(f.read())
    data = torch.frombuffer(bytearray(b"\n".join(chunks)), dtype=torch.uint8).long()
    return data


def get_batch(data, batch_size, block_size, generator):
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
    x = torch.stack([data[i : i + block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])
    return x, y


# --------------------------------------------------------------------------- #
# Training
# --------------------------------------------------------------------------- #
def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--out-dir", type=str, default="./pp_out")
    return p.parse_args()


def main():
    args = parse_args()
    tg.init()
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    stage_idx, num_stages = rank, world_size
    is_first = stage_idx == 0
    is_last = stage_idx == num_stages - 1
    device = torch.device("cpu")
    assert args.batch_size % args.microbatches == 0

    torch.use_deterministic_algorithms(True)

    data = load_corpus()
    vocab_size = 256

    model = build_stage_module(args, stage_idx, num_stages, vocab_size).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[rank {rank}] stage {stage_idx}: {n_params:,} params, "
          f"layers={list(model.layers.keys())}", flush=True)

    stage = PipelineStage(model, stage_idx, num_stages, device)

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    schedule = schedule_cls(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)

    # AdamW: no weight decay on biases / norms / embeddings-style 1-D params.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )

    def lr_lambda(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cosine

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    optimizer = tg.Optimizer(optimizer, lr_scheduler=scheduler)

    # Every rank draws the *same* batch stream (stage 0 needs x, the last stage
    # needs y). Use a dedicated generator: the global RNG is consumed by dropout,
    # and different stages consume different amounts of it, so drawing batches
    # from the global generator would silently desynchronise inputs and targets.
    data_gen = torch.Generator().manual_seed(args.seed)
    # Dropout RNG: different stream per stage (same seed on both would correlate
    # masks across stages), but reproducible run to run.
    torch.manual_seed(args.seed + 1000 * (stage_idx + 1))

    start_step = tg.start_step()
    t0 = time.time()
    for step in range(start_step, args.steps):
        x, y = get_batch(data, args.batch_size, args.block_size, data_gen)
        optimizer.zero_grad(set_to_none=True)

        if is_first:
            schedule.step(x.to(device))
        elif is_last:
            losses = []
            schedule.step(target=y.to(device), losses=losses)
        else:
            schedule.step()

        # Global grad-norm clipping: each stage only sees its own grads, so
        # reduce the squared norm across stages before clipping.
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        local_norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        sq = local_norm.pow(2)
        dist.all_reduce(sq, op=dist.ReduceOp.SUM)
        total_norm = sq.sqrt()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), args.grad_clip, total_norm)

        lr = scheduler.get_last_lr()[0]  # LR used for this update
        optimizer.step()
        scheduler.step()

        if is_last and (step % args.log_every == 0 or step == args.steps - 1):
            loss = torch.stack(losses).mean().item()
            print(f"step {step:4d} | loss {loss:.4f} | grad_norm {total_norm.item():.3f} "
                  f"| lr {lr:.2e} | {time.time() - t0:.1f}s",
                  flush=True)

    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"stage{stage_idx}.pt")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    print(f"[rank {rank}] saved {path} ({time.time() - t0:.1f}s)", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
