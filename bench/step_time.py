"""Step time of 2-worker digits training: trainguard (`trainguard run`, Model.train with its
deterministic gradient sum and a snapshot every step) against the same model under plain
torchrun + DDP. The two alternate, 5 runs each; each run reports its median step time after
10 warm-up steps, and the figure is the median of the 5.

    python bench/step_time.py [--runs 5] [--epochs 6]
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP_TIME = re.compile(r"step time: ([0-9.]+) ms \(median of (\d+)(, whole run)?\)")


def run(cmd: list[str]) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TG_FAULT": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    found = [float(m.group(1)) for m in STEP_TIME.finditer(proc.stdout) if m.group(3)]
    if not found:
        sys.exit(f"no step time in the output of {' '.join(cmd)}:\n{proc.stdout[-2000:]}")
    return statistics.median(found)  # one figure per rank: their median


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args()
    epochs = ["--epochs", str(args.epochs)]
    trainguard = [sys.executable, "-m", "trainguard", "run", "--workers", "2", "--hot-spares", "0",
                  "examples/digits.py", *epochs]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "bench/digits_ddp.py", *epochs]
    tg, ddp = [], []
    for i in range(args.runs):
        tg.append(run(trainguard))
        ddp.append(run(torchrun))
        print(f"run {i + 1}: trainguard {tg[-1]:.2f} ms, torchrun DDP {ddp[-1]:.2f} ms", flush=True)
    a, b = statistics.median(tg), statistics.median(ddp)
    print(f"step time, 2 workers, digits CNN, median of {args.runs}: trainguard {a:.2f} ms, "
          f"torchrun DDP {b:.2f} ms, ratio {a / b:.2f}x")


if __name__ == "__main__":
    main()
