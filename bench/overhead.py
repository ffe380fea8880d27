"""What protection costs: trainguard (`trainguard run`, its defaults) against plain torchrun +
DistributedDataParallel on the same workload, bench/mlp.py (an MLP on synthetic data, SGD with
momentum, gloo on CPU), at about 1M, 5M and 18M parameters on 2 and 4 workers; then the
examples/ddp_tutorial.py pair. The two setups alternate, --runs times each; each run reports its
median step time after the warm-up (the tutorial: its median epoch time after the first epoch),
and a cell's figure is the median over the runs. Peak RSS is the largest ru_maxrss of any rank in
any run. Each run is 10-20 s of process start-up, about 5 s of warm-up steps and 2-4 s of timed
steps; with --runs 3 the whole benchmark took 9.5 minutes on a 2-core machine.

    python bench/overhead.py [--runs 5] [--cells 1m:2,18m:4] [--no-tutorial]
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP_TIME = re.compile(r"median step time: ([0-9.]+) ms")
PEAK_RSS = re.compile(r"peak rss: rank (\d+) ([0-9.]+) MB, ([0-9.na]+) page faults per step")
EPOCH_TIME = re.compile(r"epoch (\d+) \| steps \d+ \| mean loss [0-9.]+ \| ([0-9.]+) ms")
# (warm-up steps, timed steps) per run: about 5 s of warm-up, then 2-4 s of timed steps. The warm-up covers
# start-up work that is not a per-step cost: torch's first iterations, and trainguard's hot spare, which
# imports torch during the first seconds and on a 2-core machine takes CPU from the workers meanwhile
CELLS = {("1m", 2): (250, 150), ("1m", 4): (120, 70), ("5m", 2): (60, 35), ("5m", 4): (30, 20),
         ("18m", 2): (15, 10), ("18m", 4): (8, 6)}
TUTORIAL_WORKERS, TUTORIAL_EPOCHS = 2, 10
TIMEOUT_S = 300


def run(cmd: list[str], *, retry: bool = True) -> str:
    """stdout of one run. A failed run is run once more, saying so: torch's own gloo teardown sometimes
    aborts a finished plain-torchrun process (SIGABRT in destroy_process_group, seen once here)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TG_FAULT": ""}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        sys.exit(f"timed out after {TIMEOUT_S} s: {' '.join(cmd)}\n{out[-2000:]}\n{err[-2000:]}")
    if proc.returncode != 0:
        why = f"failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        if not retry:
            sys.exit(why)
        print(f"note: a run failed (exit {proc.returncode}, last line: {proc.stderr.strip()[-200:]!r}); running it "
              "once more", flush=True)
        return run(cmd, retry=False)
    return proc.stdout


def torchrun(workers: int, script: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers),
            script, *args]


def trainguard(workers: int, script: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "trainguard", "run", "--workers", str(workers), script, *args]


def mlp_run(cmd: list[str], workers: int) -> tuple[float, float, float]:
    """(median step time in ms, peak RSS in MB over the ranks, page faults per timed step summed over
    the ranks) of one bench/mlp.py run."""
    out = run(cmd)
    times = STEP_TIME.findall(out)
    ranks = {int(r): (float(mb), float(faults)) for r, mb, faults in PEAK_RSS.findall(out)}
    if len(times) != 1 or sorted(ranks) != list(range(workers)):
        sys.exit(f"expected one step time and {workers} peak RSS lines from {' '.join(cmd)}:\n{out[-2000:]}")
    return float(times[0]), max(mb for mb, _ in ranks.values()), sum(f for _, f in ranks.values())


def tutorial_run(launcher, script: str) -> float:
    """Median epoch time in ms after the first epoch, from rank 0's epoch lines; a fresh snapshot path."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = launcher(TUTORIAL_WORKERS, script, "--total-epochs", str(TUTORIAL_EPOCHS),
                       "--snapshot-path", str(Path(tmp) / "snapshot.pt"))
        out = run(cmd)
    epochs = {int(e): float(ms) for e, ms in EPOCH_TIME.findall(out)}
    if sorted(epochs) != list(range(TUTORIAL_EPOCHS)):
        sys.exit(f"expected epochs 0..{TUTORIAL_EPOCHS - 1} from {' '.join(cmd)}:\n{out[-2000:]}")
    return statistics.median(epochs[e] for e in range(1, TUTORIAL_EPOCHS))


def parse_cells(text: str, known=None) -> list[tuple[str, int]]:
    """"1m:2,5m:4" -> [("1m", 2), ("5m", 4)], each one of `known` (default: this benchmark's CELLS)."""
    known = CELLS if known is None else known
    cells = []
    for item in filter(None, text.split(",")):
        params, _, workers = item.partition(":")
        if (params, int(workers or 0)) not in known:
            raise argparse.ArgumentTypeError(f"unknown cell {item!r}; known: "
                                             + ", ".join(f"{p}:{w}" for p, w in known))
        cells.append((params, int(workers)))
    return cells


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5, help="runs of each setup per cell (fewer for a quick look)")
    parser.add_argument("--cells", type=parse_cells, default=list(CELLS), help="e.g. 1m:2,18m:4 (default: all six)")
    parser.add_argument("--no-tutorial", action="store_true", help="skip the examples/ddp_tutorial.py pair")
    args = parser.parse_args()
    started = time.monotonic()

    rows = []
    for params, workers in args.cells:
        warmup, steps = CELLS[params, workers]
        mlp = ["--params", params, "--warmup", str(warmup), "--steps", str(steps)]
        tg, ddp = [], []
        for i in range(args.runs):
            tg.append(mlp_run(trainguard(workers, "bench/mlp.py", *mlp, "--trainguard"), workers))
            ddp.append(mlp_run(torchrun(workers, "bench/mlp.py", *mlp), workers))
            print(f"{params} x {workers} run {i + 1}: trainguard {tg[-1][0]:.2f} ms, DDP {ddp[-1][0]:.2f} ms",
                  flush=True)
        a, b = statistics.median(t for t, _, _ in tg), statistics.median(t for t, _, _ in ddp)
        ra, rb = max(r for _, r, _ in tg), max(r for _, r, _ in ddp)
        fa, fb = statistics.median(f for _, _, f in tg), statistics.median(f for _, _, f in ddp)
        rows.append((f"{params.upper()} x {workers}", a, b, ra, rb, fa, fb))

    if not args.no_tutorial:
        tg_ep, ddp_ep = [], []
        for i in range(args.runs):
            tg_ep.append(tutorial_run(trainguard, "examples/ddp_tutorial.py"))
            ddp_ep.append(tutorial_run(torchrun, "examples/ddp_tutorial_torchrun.py"))
            print(f"ddp_tutorial run {i + 1}: trainguard {tg_ep[-1]:.1f} ms/epoch, DDP {ddp_ep[-1]:.1f} ms/epoch",
                  flush=True)
        tutorial = statistics.median(tg_ep), statistics.median(ddp_ep)

    print(f"\nmedian of {args.runs} runs each, alternating; step time in ms; peak RSS in MB (max over ranks); "
          "minor page faults per timed step (all ranks)")
    print(f"{'cell':<10} {'trainguard':>10} {'DDP':>9} {'ratio':>6} {'RSS tg':>8} {'RSS DDP':>8} {'ratio':>6} "
          f"{'flt tg':>7} {'flt DDP':>7}")
    for cell, a, b, ra, rb, fa, fb in rows:
        print(f"{cell:<10} {a:>10.2f} {b:>9.2f} {a / b:>6.2f} {ra:>8.0f} {rb:>8.0f} {ra / rb:>6.2f} {fa:>7.1f} {fb:>7.1f}")
    if not args.no_tutorial:
        a, b = tutorial
        print(f"ddp_tutorial.py, {TUTORIAL_WORKERS} workers, ms per epoch: trainguard {a:.1f}, DDP {b:.1f}, "
              f"ratio {a / b:.2f}")
    print(f"took {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
