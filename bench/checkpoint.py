"""Checkpoint save cost of trainguard, on one model + Adam state in one process, against a plain
memcpy, `dd`, torch.save and torch.distributed.checkpoint (DCP).

    python bench/checkpoint.py [--mb 300] [--repeats 3] [--dir PATH] [--recycle-memory]

1. blocking: what the training loop waits for in an async save (the session's snapshot, a
   private CPU copy by flatten_state(copy=True), then ModelCheckpoint.save handing the write to
   its thread) against copying the same tensors with empty_like + copy_.
2. write: format.save_checkpoint (sha256, fsync, manifest, rename) of the snapshot against
   `dd if=/dev/zero bs=1M conv=fsync` of as many bytes, on the same filesystem.
3. torch.save (fsync included) and DCP save / async_save against trainguard's.
Every figure is the median of --repeats runs, after one warm-up run of each. Files go to a temp
folder under --dir (default: the repository, on disk, not tmpfs), removed at the end.
"""

import argparse
import ctypes
import ctypes.util
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainguard.checkpoint.blob import pack  # noqa: E402
from trainguard.checkpoint.codec import flatten_state  # noqa: E402
from trainguard.checkpoint.format import save_checkpoint  # noqa: E402
from trainguard.train.state.checkpointing import CheckpointConfig, ModelCheckpoint  # noqa: E402
from trainguard.train.engine.snapshots import Snapshot, SnapshotStore  # noqa: E402
from trainguard.train.state.train_state import TrainState, capture_rng  # noqa: E402

MIB = 2**20
WIDTH = 2048
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def filesystem(path: Path) -> str:
    """'device type mountpoint' of the mount holding `path` (longest matching mountpoint)."""
    best = ("?", "?", "")
    for line in Path("/proc/mounts").read_text().splitlines():
        dev, mnt, kind = line.split()[:3]
        if str(path).startswith(mnt.rstrip("/") + "/") and len(mnt) > len(best[2]):
            best = (dev, kind, mnt)
    return f"{best[0]} {best[1]} on {best[2]}"


def build_state(mb: int) -> TrainState:
    """Linear layers whose params + Adam's exp_avg + exp_avg_sq come to about `mb` MiB."""
    layers = max(1, round(mb * MIB / (3 * 4 * (WIDTH * WIDTH + WIDTH))))
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # fills exp_avg / exp_avg_sq
    opt.zero_grad(set_to_none=True)
    return TrainState(model=model, optimizer=opt)


class FakeSession:
    """What ModelCheckpoint.save reads from a Session; `_snapshot` does what Session._snapshot
    does in a single process (the all-gather of the small per-rank blob is left out)."""

    def __init__(self, state: TrainState) -> None:
        self.state, self.step, self.steps_per_epoch = state, 1, None
        self.rt = SimpleNamespace(rank=0, world_size=1)
        self.snapshots = SnapshotStore(1)

    def _snapshot(self) -> None:
        tensors, meta = flatten_state(self.state.capture_shared(), copy=True)
        own = pack({"rng": capture_rng(), "progress": {"step": self.step, "epoch": 0, "in_epoch": self.step}})
        self.snapshots.put(Snapshot(self.step, tensors, meta, own))


def timed(fn) -> float:
    t = time.perf_counter()
    result = fn()  # freed after the clock stops
    took = time.perf_counter() - t
    del result
    return took


def fresh_pages() -> None:
    """Make glibc mmap every allocation of 1 MiB or more (and unmap it when freed), so every copy
    lands on fresh pages. By default glibc recycles freed blocks below 32 MiB, and a copy then
    costs 2-4x less or more depending on what the previous case happened to free."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not libc.mallopt(M_MMAP_THRESHOLD, MIB):
        print("warning: mallopt failed; copy times depend on what earlier cases freed")


def settle(*paths: Path) -> None:
    """Remove earlier outputs and flush dirty pages, so that no run pays for another's writeback."""
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    os.sync()


# --- the cases: each returns {name: seconds} for one run ---------------------------------------


def run_blocking(state: TrainState, work: Path) -> dict[str, float]:
    out = {}
    live = flatten_state(state.capture_shared(), copy=False)[0]
    out["memcpy (empty_like + copy_)"] = timed(lambda: [torch.empty_like(t).copy_(t) for t in live.values()])
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in live.values()])
    out["memcpy (one tensor clone)"] = timed(flat.clone)
    del flat
    ckpt = ModelCheckpoint("bench", work / "tg_async", CheckpointConfig(keep_checkpoint_max=2))
    t0 = time.perf_counter()
    ckpt.save(FakeSession(state))  # takes the snapshot, then starts the writer thread
    t1 = time.perf_counter()
    ckpt.wait()
    t2 = time.perf_counter()
    if ckpt.errors:
        sys.exit(f"trainguard async save failed: {ckpt.errors}")
    out["trainguard async: blocking"], out["trainguard async: total"] = t1 - t0, t2 - t0
    settle(work / "tg_async")
    return out


def dd_seconds(path: Path, mib: int) -> float:
    proc = subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "conv=fsync"],
                          capture_output=True, text=True, check=True, env={**os.environ, "LC_ALL": "C"})
    found = re.search(r"copied, ([0-9.e+-]+) s", proc.stderr)
    if not found:
        sys.exit(f"cannot read dd's time from: {proc.stderr}")
    return float(found.group(1))


def run_write(snap: dict, meta: dict, mib: int, work: Path) -> dict[str, float]:
    out = {}
    folder = work / "tg_write"
    out["trainguard save_checkpoint"] = timed(lambda: save_checkpoint(
        folder, {"rank_0.safetensors": snap}, meta=meta, step=1, epoch=0, world_size=1))
    settle(folder)
    out["dd bs=1M conv=fsync"] = dd_seconds(work / "dd.bin", mib)
    settle(work / "dd.bin")
    return out


def run_others(state: TrainState, work: Path) -> dict[str, float]:
    out = {}
    live = {"model": state.model.state_dict(), "optim": state.optimizer.state_dict()}
    tensors, meta = flatten_state(state.capture_shared(), copy=False)
    out["trainguard sync (no copy)"] = timed(lambda: save_checkpoint(
        work / "tg_sync", {"rank_0.safetensors": tensors}, meta=meta, step=1, epoch=0, world_size=1))
    settle(work / "tg_sync")

    def torch_save() -> None:
        with open(work / "torch.pt", "wb") as f:
            torch.save(live, f)
            f.flush()
            os.fsync(f.fileno())
    out["torch.save + fsync"] = timed(torch_save)
    settle(work / "torch.pt")
    out["DCP save"] = timed(lambda: dcp.save(live, checkpoint_id=work / "dcp", no_dist=True))
    settle(work / "dcp")
    t0 = time.perf_counter()
    future = dcp.async_save(live, checkpoint_id=work / "dcp_async", no_dist=True)
    t1 = time.perf_counter()
    (future.upload_completion if hasattr(future, "upload_completion") else future).result()
    t2 = time.perf_counter()
    out["DCP async_save: blocking"], out["DCP async_save: total"] = t1 - t0, t2 - t0
    settle(work / "dcp_async")
    return out


# --- report --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=300, help="MiB of model + Adam state (default 300)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=REPO, help="where the temp folder goes (default: the repo)")
    parser.add_argument("--recycle-memory", action="store_true",
                        help="keep glibc's default, which reuses freed memory for copies (less stable)")
    args = parser.parse_args()
    if not args.recycle_memory:
        fresh_pages()
    warnings.filterwarnings("ignore", module="torch.distributed")

    state = build_state(args.mb)
    snap, meta = flatten_state(state.capture_shared(), copy=True)
    nbytes = sum(t.numel() * t.element_size() for t in snap.values())
    mib = nbytes / MIB
    work = Path(tempfile.mkdtemp(prefix=".bench-ckpt-", dir=args.dir)).resolve()
    print(f"state: {len(snap)} tensors, {mib:.1f} MiB ({sum(p.numel() for p in state.model.parameters()):,} params "
          f"+ Adam); torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"files in {work} ({filesystem(work)}); median of {args.repeats} after 1 warm-up; copies on "
          f"{'recycled memory' if args.recycle_memory else 'fresh pages'}", flush=True)
    runs: dict[str, list[float]] = {}
    try:
        for i in range(args.repeats + 1):
            for case in (lambda: run_blocking(state, work), lambda: run_write(snap, meta, math.ceil(mib), work),
                         lambda: run_others(state, work)):
                for name, s in case().items():
                    if i:  # run 0 is the warm-up
                        runs.setdefault(name, []).append(s)
            if i:
                print(f"  run {i} done, load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def size(name: str) -> float:
        return math.ceil(mib) if name.startswith("dd") else mib  # dd writes whole MiB

    def ratio(a: str, b: str, stat=statistics.median) -> float:
        """Seconds per MiB of case `a` over those of case `b`."""
        return (stat(runs[a]) / size(a)) / (stat(runs[b]) / size(b))

    print(f"\n{'case':<30} {'median s':>9} {'MiB/s':>8} {'min s':>7}   runs (s)")
    for name, v in runs.items():
        med = statistics.median(v)
        print(f"{name:<30} {med:9.3f} {size(name) / med:8.0f} {min(v):7.3f}   " + " ".join(f"{s:.3f}" for s in v))

    print(f"\n{'ratio (of medians)':<55} {'':>6}  {'':4} {'target':>8}   of minima")
    checks = [  # label, a, b, target on (seconds per MiB of a) / (those of b)
        ("1. trainguard async blocking / memcpy (empty_like+copy_)", "trainguard async: blocking",
         "memcpy (empty_like + copy_)", "<= 1.5"),
        ("   (reference) trainguard async blocking / one clone", "trainguard async: blocking",
         "memcpy (one tensor clone)", ""),
        ("2. save_checkpoint MiB/s / dd MiB/s", "dd bs=1M conv=fsync", "trainguard save_checkpoint", ">= 0.8"),
        ("3a. trainguard sync (no copy) / DCP save", "trainguard sync (no copy)", "DCP save", "<= 1.0"),
        ("3b. trainguard async blocking / DCP async_save blocking", "trainguard async: blocking",
         "DCP async_save: blocking", "<= 1.0"),
        ("3c. trainguard async total / DCP async_save total", "trainguard async: total",
         "DCP async_save: total", "<= 1.0"),
        ("   (reference) trainguard sync / torch.save + fsync", "trainguard sync (no copy)",
         "torch.save + fsync", ""),
    ]
    for label, a, b, target in checks:
        r, r_min = ratio(a, b), ratio(a, b, min)
        verdict = ""
        if target:
            op, limit = target.split()
            verdict = "PASS" if (r <= float(limit) if op == "<=" else r >= float(limit)) else "MISS"
        print(f"{label:<55} {r:6.2f}x  {verdict:4} {target:>8}   {r_min:.2f}x")

if __name__ == "__main__":
    main()
