"""PyTorch's FSDP2 tutorial (pytorch/examples, distributed/FSDP2: example.py and its model.py), ported to
trainguard. The 5 lines marked `# trainguard` are the port; the rest is the tutorial's script.

    trainguard run --workers 3 examples/fsdp2_tutorial.py --steps 40
    TG_FAULT=2:20:kill trainguard run --workers 3 examples/fsdp2_tutorial.py --steps 40   # kill -9 rank 2 at step 20

What the port changes: `tg.init()` stands where `init_process_group` stood, `fully_shard` comes from
trainguard (torch's, noting the model), the optimizer is wrapped, and the step loop starts where the job
is (`tg.start_step()`). A killed rank is replaced and every rank goes back to the committed step: the
survivors run the script again in their processes and keep their shards, the replacement takes its
shard from the in-memory copy its buddy holds.

Left out here, and not part of the port: the tutorial's check that exits without 2 GPUs (this runs on
CPU, gloo), its DCP `Checkpointer` (trainguard's dying-gasp checkpoint covers a stop), and its mixed
precision and explicit prefetching flags; the model's sizes and the step count are flags, so that the
tests run it small.

--out DIR: at the end every rank writes its part of the final model and optimizer state
(DIR/rank<r>.safetensors, trainguard.save_state), so that two runs can be compared tensor by tensor.
"""

import argparse
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import trainguard as tg  # trainguard
from trainguard import fully_shard  # trainguard: was `from torch.distributed.fsdp import fully_shard`


# --- model.py ------------------------------------------------------------------------------------------
@dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 8
    max_seq_len: int = 16
    dim: int = 16
    n_heads: int = 4
    dropout_p: float = 0.1


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        assert args.dim % args.n_heads == 0
        self.head_dim = args.dim // args.n_heads
        self.n_heads = args.n_heads
        self.dropout_p = args.dropout_p
        self.resid_dropout = nn.Dropout(args.dropout_p)
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x):
        bsz, seq_len, _ = x.size()
        queries, keys, values = self.wq(x), self.wk(x), self.wv(x)
        queries = queries.view(bsz, seq_len, self.n_heads, self.head_dim)
        keys = keys.view(bsz, seq_len, self.n_heads, self.head_dim)
        values = values.view(bsz, seq_len, self.n_heads, self.head_dim)
        queries = queries.transpose(1, 2)  # (bsz, n_heads, seq_len, head_dim)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)
        output = F.scaled_dot_product_attention(queries, keys, values, None,
                                                self.dropout_p if self.training else 0, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bsz, seq_len, -1)
        return self.resid_dropout(self.wo(output))

    def reset_parameters(self):
        self.wq.reset_parameters()
        self.wk.reset_parameters()
        self.wv.reset_parameters()
        self.wo.reset_parameters()


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, dropout_p):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.gelu = nn.GELU()
        self.w2 = nn.Linear(hidden_dim, dim)
        self.resid_dropout = nn.Dropout(dropout_p)

    def forward(self, x):
        return self.resid_dropout(self.w2(self.gelu(self.w1(x))))

    def reset_parameters(self):
        self.w1.reset_parameters()
        self.w2.reset_parameters()


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args.dim, hidden_dim=4 * args.dim, dropout_p=args.dropout_p)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))

    def reset_parameters(self):
        self.attention_norm.reset_parameters()
        self.attention.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.feed_forward.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        assert args.vocab_size is not None
        assert args.max_seq_len is not None
        self.model_args = args
        self.max_seq_len = args.max_seq_len
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.dropout = nn.Dropout(args.dropout_p)
        self.layers = nn.ModuleList()
        for _ in range(args.n_layers):
            self.layers.append(TransformerBlock(args))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens):
        _bsz, seq_len = tokens.size()
        assert seq_len <= self.max_seq_len
        h = self.tok_embeddings(tokens)
        pos = torch.arange(0, seq_len, device=tokens.device)
        p = self.pos_embeddings(pos)  # positional embeddings of shape (seq_len, dim)
        h = h + p
        h = self.dropout(h)
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        return self.output(h).float()

    def reset_parameters(self):
        for layer in self.layers:
            layer.reset_parameters()
        self.tok_embeddings.reset_parameters()
        self.pos_embeddings.reset_parameters()
        self.norm.reset_parameters()
        self.output.reset_parameters()


# --- example.py ----------------------------------------------------------------------------------------
def main(args):
    rank = int(os.environ["LOCAL_RANK"])
    if torch.accelerator.is_available():
        device_type = torch.accelerator.current_accelerator()
        device = torch.device(f"{device_type}:{rank}")
        torch.accelerator.device_index(rank)
        print(f"Running on rank {rank} on device {device}")
    else:
        device = torch.device("cpu")
        print(f"Running on device {device}")

    backend = torch.distributed.get_default_backend_for_device(device)  # noqa: F841 (the tutorial's line)
    tg.init()  # trainguard: was torch.distributed.init_process_group(backend=backend, device_id=device)

    torch.manual_seed(0)
    vocab_size = 1024
    batch_size = args.batch_size
    seq_len = 64
    model_args = ModelArgs(n_layers=args.layers, n_heads=4, vocab_size=vocab_size, max_seq_len=seq_len,
                           dropout_p=args.dropout)
    with torch.device("meta"):
        model = Transformer(model_args)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)

    model.to_empty(device=device)
    model.reset_parameters()

    optim = tg.Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))  # trainguard: the commit point

    for _ in range(tg.start_step(), args.steps):  # trainguard: was range(10)
        x = torch.randint(0, vocab_size, (batch_size, seq_len), device=device)
        loss = model(x).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()

    if args.out:
        write_parts(model, optim, args.out)
    torch.distributed.destroy_process_group()


def write_parts(model, optim, out):
    """Every rank's local part of the final model and optimizer state (DTensors as their local shards)."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    state = {"model": {k: local(v) for k, v in model.state_dict().items()},
             "optim": {str(i): {k: local(v) for k, v in s.items()} for i, s in optim.state_dict()["state"].items()}}
    os.makedirs(out, exist_ok=True)
    tg.save_state(os.path.join(out, f"rank{torch.distributed.get_rank()}.safetensors"), state)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="PyTorch FSDP2 example")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--out", default="")
    main(parser.parse_args())
