"""What the replay audit (train/engine/audit.py) costs: the same trainguard runs with `--exact warn` (the default)
and `--exact off`, alternating, on the data-parallel benchmark (bench/mlp.py) and the FSDP2 one
(bench/fsdp_step.py); medians over --runs and their ratio. Then the audit's own work per training forward
(fingerprinting the inputs and the output), timed in this process on the benchmarks' shapes, as a share of
their step time: a figure that run-to-run noise (a few percent between identical runs here) cannot hide.

    python bench/audit.py [--runs 5] [--cells 1m:2,5m:2]
"""

import argparse
import statistics
import sys
import time
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import CELLS, mlp_run, parse_cells, trainguard  # noqa: E402
from sharded_overhead import CELLS as FSDP_CELLS  # noqa: E402
from sharded_overhead import one as fsdp_run  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainguard.train.engine.audit import Audit  # noqa: E402

IN, OUT, BATCH = 64, 10, 32  # bench/mlp.py's and bench/fsdp_step.py's input width, classes, batch per rank


def per_forward_us() -> float:
    """Microseconds of Audit.forward per training forward (its first run: the fingerprints are taken and kept)."""
    audit, x, y, out = Audit(True), torch.randn(BATCH, IN), torch.randint(0, OUT, (BATCH,)), torch.randn(BATCH, OUT)
    steps = iter(range(10**9))
    n = 20000
    return 1e6 * min(timeit.repeat(lambda: audit.forward(next(steps), 0, ((x, y), {}), out), number=n, repeat=5)) / n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cells", type=parse_cells, default=[("1m", 2), ("5m", 2)])
    parser.add_argument("--fsdp-cells", type=lambda t: parse_cells(t, FSDP_CELLS), default=[("1m", 2)])
    args = parser.parse_args()
    started = time.monotonic()
    rows = []
    for bench, cells, table in (("mlp", args.cells, CELLS), ("fsdp", args.fsdp_cells, FSDP_CELLS)):
        for params, workers in cells:
            warmup, steps = table[params, workers]
            flags = ["--params", params, "--warmup", str(warmup), "--steps", str(steps), "--trainguard"]
            script = "bench/mlp.py" if bench == "mlp" else "bench/fsdp_step.py"
            times = {"warn": [], "off": []}
            for i in range(args.runs):
                for mode in (("warn", "off") if i % 2 == 0 else ("off", "warn")):
                    cmd = trainguard(workers, script, *flags)
                    cmd[4:4] = ["--exact", mode]
                    ms = mlp_run(cmd, workers)[0] if bench == "mlp" else fsdp_run(cmd, workers)[0]
                    times[mode].append(ms)
                print(f"{bench} {params} x {workers} run {i + 1}: audit on {times['warn'][-1]:.2f} ms, "
                      f"off {times['off'][-1]:.2f} ms", flush=True)
            rows.append((f"{'DP' if bench == 'mlp' else 'FSDP2'} {params.upper()} x {workers}",
                         statistics.median(times["warn"]), statistics.median(times["off"])))
    us = per_forward_us()
    print(f"\nmedian of {args.runs} runs each, alternating; step time in ms")
    print(f"{'cell':<16} {'audit on':>9} {'off':>9} {'ratio':>6} {'audit work':>11}")
    for cell, on, off in rows:
        print(f"{cell:<16} {on:>9.2f} {off:>9.2f} {on / off:>6.3f} {100 * us / 1000 / off:>10.2f}%")
    print(f"audit work: {us:.1f} us per training forward (fingerprints of a [{BATCH}, {IN}] batch, its labels and "
          f"the [{BATCH}, {OUT}] output), one forward per step; took {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
