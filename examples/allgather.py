"""All-gather of each rank's id, as in MindSpore's nccl_allgather.py (reference 001).

    trainguard run --workers 4 examples/allgather.py
Expected on every rank: [[0.], [1.], [2.], [3.]]
"""

import torch
import torch.distributed as dist

import trainguard

trainguard.init()
value = torch.tensor([[float(trainguard.get_rank())]])
out = [torch.zeros_like(value) for _ in range(trainguard.get_world_size())]
dist.all_gather(out, value, group=trainguard.get_group())
print("[" + ",".join(f"[{v:.0f}.]" for v in torch.cat(out).flatten().tolist()) + "]", flush=True)
