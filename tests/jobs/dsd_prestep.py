"""A port that reads its optimizer's state with torch's distributed state-dict helpers before the loop (as a
torchtitan-style resume does): on an optimizer with no state yet, `get_optimizer_state_dict` steps it once at LR 0
to make one. The optimizer is a trainguard.Optimizer's, so that step is no unported script's: nothing is said
(tests/test_frameworks.py)."""

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import trainguard as tg

dist.init_process_group("gloo")
torch.manual_seed(0)
net = torch.nn.Linear(4, 2)
model = tg.DDP(net)
base = torch.optim.AdamW(net.parameters(), lr=1e-3)
optimizer = tg.Optimizer(base)
get_optimizer_state_dict(net, base)  # steps `base` at LR 0: it had no state
for step in range(tg.start_step(), 3):
    optimizer.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
dist.destroy_process_group()
