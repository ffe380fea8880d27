"""What trainguard costs a framework's script: examples/<framework>/train_plain.py under torchrun against
examples/<framework>/train.py (the same script, ported) under `trainguard run`, 3 workers on CPU (gloo), for Hugging
Face Accelerate, the transformers Trainer and PyTorch Lightning (bench/frameworks.py). The two alternate, --runs times each; each run
reports the median interval between its optimizer steps after a warm-up (bench/steptimer/sitecustomize.py, which times
any script through torch's global optimizer-step hook), and the figure is the median over the runs; beside it, the
median of the paired ratios (each trainguard run over the torchrun run next to it), which the machine's drift between
pairs moves less. The scripts' own checkpoints are off.

    python bench/framework_overhead.py [--framework accelerate|transformers|lightning] [--runs 5] [--epochs 20] [--channels 16]
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

from frameworks import LABELS, NAMES, REPO, WORKERS, scripts

STEP_TIME = re.compile(r"median step time: ([0-9.]+) ms \((\d+) steps timed\), CPU time per step: ([0-9.]+) ms")
TIMER = REPO / "bench" / "steptimer"  # a sitecustomize: on PYTHONPATH, with STEPTIMER=1


def run(cmd: list[str], cwd: str) -> tuple[float, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TG_FAULT": "", "STEPTIMER": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TIMER), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    found = STEP_TIME.search(proc.stdout + proc.stderr)
    if found is None:
        sys.exit(f"failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    if proc.returncode != 0:  # trained and timed, then failed at its exit (seen: the plain Lightning script under
        # torchrun, SIGABRT in a worker's teardown): its steps count, and the run says so
        print(f"note: exit {proc.returncode} after the timed steps: {' '.join(cmd[:4])}...", flush=True)
    return float(found.group(1)), float(found.group(3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=NAMES, default="accelerate")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument("--channels", type=int, default=16, help="the model's width (the example's --channels)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cwd:
        plain_script, port = scripts(args.framework, args.epochs, args.channels, os.path.join(cwd, "out"),
                                     args.workers)
        plain = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.workers),
                 *plain_script]
        guarded = [sys.executable, "-m", "trainguard", "run", "--workers", str(args.workers), *port]
        measure(args, plain, guarded, cwd)


def measure(args, plain: list[str], guarded: list[str], cwd: str) -> None:
    label = LABELS[args.framework]
    times: dict[str, list[float]] = {f"torchrun + {label}": [], f"trainguard + {label}": []}
    spent: dict[str, list[float]] = {name: [] for name in times}
    for i in range(args.runs):
        for name, cmd in zip(times, (plain, guarded)) if i % 2 == 0 else reversed(list(zip(times, (plain, guarded)))):
            wall, used = run(cmd, cwd)
            times[name].append(wall)
            spent[name].append(used)
            print(f"run {i + 1}: {name}: {wall:.3f} ms a step, {used:.3f} ms of CPU (rank 0)", flush=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"\n{args.framework}: {args.workers} workers, --channels {args.channels}, {args.epochs} epochs a run, "
          f"{args.runs} runs each, alternating")
    for name, m in medians.items():
        print(f"{name:26s} median step time {m:.3f} ms  (runs: {', '.join(f'{t:.3f}' for t in times[name])})")
    for name in times:
        print(f"{name:26s} median CPU time per step (rank 0) {statistics.median(spent[name]):.3f} ms")
    ours, theirs = f"trainguard + {label}", f"torchrun + {label}"
    ratio = medians[ours] / medians[theirs]
    cpu_ratio = statistics.median(spent[ours]) / statistics.median(spent[theirs])
    print(f"ratio trainguard / torchrun: {ratio:.3f} (step time), {cpu_ratio:.3f} (CPU time per step)")
    # each run beside the other one of its pair, run next to it: what the machine's drift between pairs moves less
    paired = [a / b for a, b in zip(times[ours], times[theirs])]
    print(f"median of the {len(paired)} paired ratios: {statistics.median(paired):.3f} "
          f"({', '.join(f'{r:.3f}' for r in paired)})")


if __name__ == "__main__":
    main()
