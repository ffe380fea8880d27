"""What the exact sum over virtual shards (a fixed tree: train/parallel/exactsum.py; issue 41) costs a step, against
torch's DistributedDataParallel, on real gloo processes.

Each worker process builds the same MLP (1M or 5M parameters) and runs, alternating in blocks of `--steps`
steps, (a) torch's DDP with a batch of B per rank, and (b) trainguard's gradient exchange in exact mode with
V virtual shards: each rank holds V/W shards and runs one forward and backward per shard, on B*W/V samples
each, so the global batch (V shards of B*W/V) is the same. V = W is the cost of the exact sum alone (one
shard a rank); V = 2W adds the split of a rank's batch into two backwards, and is also compared with DDP on the
same two micro-batches (`no_sync` on the first), which isolates the exact sum's own cost. Step time: median over
all blocks of rank 0's per-block mean; the ratio is exact over DDP.

    python bench/elastic_exact.py [--workers 2 4] [--width 1024] [--blocks 6] [--steps 10] [--shrink-runs 3]

Then the shrink (`--shrink-runs`): tests/jobs/vshards.py (the digits trainer of tests/test_virtual_shards.py) under
`trainguard run --workers 4 --virtual-shards 12 --recover-strategy elastic --elastic-deadline 1`, rank 1 killed
after step 10 and its replacements dying at start: the time from the kill to the first step finished at 3
workers (trainguard's own "MTTR" line: the elastic deadline is in it), and the median step time at 4 and at 3
workers (from the job's per-step timestamps).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def _worker(rank: int, world: int, port: int, args, shards: int, out: dict) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from trainguard.testing.leaving import leave_together
    from trainguard.train.parallel.exactsum import shard_range
    from trainguard.train.parallel.gradsync import GradSync

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    plain_model, exact_model = mlp(args.width), mlp(args.width)
    exact_model.load_state_dict(plain_model.state_dict())
    ddp = DistributedDataParallel(plain_model)
    sync = GradSync(exact_model)
    sync.set_shards(shards)
    sync.attach(dist.group.WORLD)
    here = shard_range(shards, world, rank)
    per_shard = args.batch * world // shards
    x, y = torch.randn(args.batch, 256), torch.randint(0, 10, (args.batch,))
    optimizers = {"ddp": torch.optim.SGD(ddp.parameters(), lr=0.01),
                  "exact": torch.optim.SGD(exact_model.parameters(), lr=0.01)}

    def step(kind: str) -> None:
        opt = optimizers["exact" if kind == "exact" else "ddp"]
        opt.zero_grad()
        if kind == "ddp":
            nn.functional.cross_entropy(ddp(x), y).backward()
        elif kind == "ddp_micro":  # DDP on the same micro-batches as the exact sum's shards (no_sync but the last)
            for i, _ in enumerate(here):
                part = slice(i * per_shard, (i + 1) * per_shard)
                with ddp.no_sync() if i < len(here) - 1 else contextlib.nullcontext():
                    nn.functional.cross_entropy(ddp(x[part]), y[part]).backward()
        else:
            for i, _ in enumerate(here):
                part = slice(i * per_shard, (i + 1) * per_shard)
                nn.functional.cross_entropy(exact_model(x[part]), y[part]).backward()
            sync.result()
        opt.step()

    kinds = ("ddp", "exact") if len(here) == 1 else ("ddp", "ddp_micro", "exact")
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for kind in kinds:  # warm-up
        for _ in range(3):
            step(kind)
    for block in range(args.blocks):
        for kind in (kinds if block % 2 == 0 else kinds[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(kind)
            times[kind].append((time.perf_counter() - t0) / args.steps)
    if rank == 0:
        out.update(times)
    leave_together(store, rank, world)


def shrink_once(tmp: Path) -> tuple[float, float, float]:
    """(MTTR, step time at 4 workers, step time at 3) of one shrink, in seconds."""
    import json
    import re
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TG_FAULT": "1:10:kill"}
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", "4", "--virtual-shards", "12", "--recover-strategy",
           "elastic", "--elastic-deadline", "1", "--recovery-path", str(tmp / "recovery"),
           str(repo / "tests" / "jobs" / "vshards.py"), "--out", str(tmp), "--epochs", "6", "--restarted", "die"]
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    found = re.search(r"MTTR ([0-9.]+) s", proc.stdout + proc.stderr)
    if proc.returncode != 0 or found is None:
        sys.exit(f"the shrink run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    times = {}
    for line in (tmp / "losses.jsonl").read_text().splitlines():
        entry = json.loads(line)
        times[entry["step"]] = entry["t"]
    steps = sorted(times)
    gaps = {s: times[s] - times[p] for p, s in zip(steps, steps[1:]) if s == p + 1}
    before = [g for s, g in gaps.items() if 2 <= s <= 10]
    after = [g for s, g in gaps.items() if s >= 14]
    return float(found.group(1)), statistics.median(before), statistics.median(after)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--width", type=int, default=1024, help="hidden width: 1024 is 1.3M parameters")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--shrink-runs", type=int, default=3)
    args = parser.parse_args()
    params = sum(p.numel() for p in mlp(args.width).parameters())
    print(f"MLP of {params / 1e6:.2f}M parameters, {args.batch} samples a rank a step; "
          f"{args.blocks} alternating blocks of {args.steps} steps")
    for world in args.workers:
        for shards in (world, 2 * world):
            with mp.Manager() as manager:
                out = manager.dict()
                mp.start_processes(_worker, args=(world, free_port(), args, shards, out), nprocs=world,
                                   start_method="spawn")
                ddp, exact = statistics.median(out["ddp"]), statistics.median(out["exact"])
                micro = statistics.median(out["ddp_micro"]) if "ddp_micro" in out else None
            same = "" if micro is None else (f"   DDP on the same {shards // world} micro-batches "
                                             f"{micro * 1e3:7.2f} ms   ratio {exact / micro:.3f}")
            print(f"W={world} V={shards:<2}  DDP {ddp * 1e3:7.2f} ms   exact {exact * 1e3:7.2f} ms   "
                  f"ratio {exact / ddp:.3f}{same}", flush=True)
    if args.shrink_runs:
        import tempfile

        runs = []
        for _ in range(args.shrink_runs):
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(shrink_once(Path(tmp)))
        mttr, at4, at3 = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"shrink 4 -> 3 (elastic deadline 1 s), {len(runs)} runs, medians: kill to the first step at 3 workers "
              f"{mttr:.3f} s; step {at4 * 1e3:.1f} ms at 4 workers, {at3 * 1e3:.1f} ms at 3 ({at3 / at4:.2f}x)")


if __name__ == "__main__":
    main()
