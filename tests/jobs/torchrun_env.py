"""Reads torchrun's environment before any trainguard call, as scripts and frameworks do, writes what it saw
(one line per run of the script in this process), then trains a few steps with torch's own init_process_group."""
import json
import os
import sys

NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
         "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
seen = {name: os.environ.get(name) for name in NAMES}
out = sys.argv[1]
with open(f"{out}/env_{seen['RANK']}.jsonl", "a") as f:
    f.write(json.dumps({**seen, "pid": os.getpid()}) + "\n")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import trainguard as tg  # noqa: E402

dist.init_process_group("gloo")
torch.manual_seed(0)
model = tg.DDP(torch.nn.Linear(4, 1))
optimizer = tg.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(tg.start_step(), 8):
    x = torch.randn(8, 4)
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
if dist.get_rank() == 0:
    torch.save(model.module.state_dict(), f"{out}/final.pt")
