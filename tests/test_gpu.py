"""The GPU checks of live recovery (issue 11) that need no job: an NCCL group of one built, aborted and
built again in one process, and a snapshot's host copy of CUDA tensors (pinned buffers, side stream)
equal to the tensors it copied, with the in-place update after it waiting for it. Skipped without
CUDA (CI has none); the kill -9 check on a shared GPU is in test_sharded_recovery.py, and the
snapshot's blocking time against a bare device-to-host copy is bench/gpu_snapshot.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from harness import REPO, env

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (CI has none): the "
                                 "GPU checks run only where a GPU is lent"), pytest.mark.timeout(120)]

NCCL_ONE = r"""
import datetime, time
import torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

torch.cuda.set_device(0)
dev = torch.device("cuda", 0)
for gen in (1, 2):
    store = dist.FileStore(f"{__import__('sys').argv[1]}.{gen}", 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev,
                            timeout=datetime.timedelta(seconds=30))
    x = torch.full((4,), float(gen), device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    assert x.tolist() == [float(gen)] * 4, x
    t0 = time.monotonic()
    c10d._abort_process_group()
    print(f"generation {gen}: built, all-reduced, aborted in {1000 * (time.monotonic() - t0):.1f} ms", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
print("ok", flush=True)
"""


def test_an_nccl_group_of_one_is_built_aborted_and_built_again(tmp_path):
    proc = subprocess.run([sys.executable, "-c", NCCL_ONE, str(tmp_path / "store")], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


def test_a_snapshot_of_cuda_tensors_is_exact_and_the_update_waits_for_it():
    from trainguard.train.parallel.buddy import HostCopy

    torch.manual_seed(0)
    tensors = {f"t{i}": torch.randn(1 << 20, device="cuda") for i in range(4)}
    want = {k: t.cpu() for k, t in tensors.items()}
    host = HostCopy()
    for _ in range(2):  # the second round reuses the pinned buffers
        copies, ready = host.take(tensors)
        host.fence()  # what the optimizer's step pre-hook does: the in-place update below waits on the device
        for t in tensors.values():
            t.mul_(2)
        ready.synchronize()
        assert all(copies[k].is_pinned() and torch.equal(copies[k], want[k]) for k in tensors)
        want = {k: t.cpu() for k, t in tensors.items()}
