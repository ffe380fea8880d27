"""A job whose survivors are inside a large collective when a peer dies (tests/test_stuck_collectives.py).

Run 1 of the script: ranks 0 and 1 enter a 100 MB all_reduce, rank 2 kills itself 1 s later without
entering it. Run 2 (after the rewind; rank 2 is a replacement): ranks 0 and 2 enter a barrier, rank 1
kills itself 1 s later. Run 3: everyone passes the barrier and the job ends. Each survivor writes when it
left the failed collective to OUT/left_<node>_<run>.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import trainguard as tg

out = sys.argv[1]
rt = tg.init()
tg.Optimizer  # noqa: B018  loads the training side, which answers the rewind

counter = os.path.join(out, f"runs_{rt.node_id}")
run = (int(open(counter).read()) if os.path.exists(counter) else 0) + 1
open(counter, "w").write(str(run))

victim = {1: 2, 2: 1}.get(run)
if rt.rank == victim and rt.incarnation == 1:
    time.sleep(1.0)
    rt.events.emit("fault_injected", rank=rt.rank, step=0, how="kill", node=rt.node_id, generation=rt.generation)
    os.kill(os.getpid(), 9)
try:
    if run == 1:
        dist.all_reduce(torch.ones(25_000_000))  # 100 MB of float32
    else:
        dist.barrier()
except tg.CollectiveFailed:
    with open(os.path.join(out, f"left_{rt.node_id}_{run}"), "w") as f:
        f.write(repr(time.time()))
    raise
print(f"rank {rt.rank}: run {run} passed", flush=True)
