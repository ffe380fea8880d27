"""Two ranks of plain torch.distributed (gloo, a 3 s timeout): rank 1 starts an all_reduce that rank 0 never
joins, and lets its group go (torch's own references dropped first, as trainguard's runtime drops them): once by
hand (the hazard: torch's destructor waits for the pending work), once through trainguard's graveyard
(worker/graveyard.py). Rank 1 prints how long each kept the calling thread, and how long the reaper took.

    python tests/jobs/pending_group.py RANK PORT
"""

import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from trainguard.worker import graveyard

rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
kept = []


def group_with_pending_work(phase: str):
    """A fresh group in which rank 1 waits for rank 0, and none of torch's references to it."""
    dist.init_process_group("gloo", store=dist.PrefixStore(phase, store), rank=rank, world_size=2,
                            timeout=timedelta(seconds=3))
    group = dist.group.WORLD
    if rank == 0:  # alive, its connections open, and never joining
        dist.destroy_process_group()
        kept.append(group)
        return None
    group.allreduce([torch.ones(4)])  # rank 0 never joins it
    dist.destroy_process_group()
    return group


for phase in ("by hand", "buried"):
    group = group_with_pending_work(phase)
    if rank == 1:
        t0 = time.monotonic()
        if phase == "buried":
            graveyard.bury([group])
            del group
            graveyard.bury([])  # the next generation dropped: the one before is let go, on a thread of its own
        else:
            del group
        print(f"{phase} {time.monotonic() - t0:.2f}", flush=True)
        store.set(phase, "done")
    else:
        store.wait([phase])  # the next phase's group is made once rank 1 let this one go
t0 = time.monotonic()
while any(t.name == "trainguard-reaper" for t in threading.enumerate()):
    time.sleep(0.05)
if rank == 1:
    print(f"reaper {time.monotonic() - t0:.2f}", flush=True)
    store.set("done", "1")
else:
    store.wait(["done"])  # alive, and not joining, until rank 1 is done
