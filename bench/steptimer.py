"""Run a training script unchanged and print the median interval between its optimizer steps (after a warm-up),
for benchmarks of scripts that print no step time of their own (bench/framework_overhead.py).

    torchrun --nproc-per-node 3 bench/steptimer.py SCRIPT ARGS
    trainguard run --workers 3 bench/steptimer.py SCRIPT ARGS

torch's global optimizer-step hook takes the time after every `step()` of any optimizer; at exit, rank 0 prints
`median step time: X ms (N steps timed), CPU time per step: Y ms` (the median of the process's CPU time, all
threads, between steps: the cost where the wall time also holds waits for the other ranks and the machine).
Env: STEPTIMER_WARMUP (steps left out at the start, default 20);
STEPTIMER_DIR (bench/framework_mttr.py): each process writes DIR/pid_<rank> at its start and appends the wall-clock
time of each of its steps to DIR/steps_<rank>.
"""

import atexit
import os
import runpy
import statistics
import sys
import time

from torch.optim.optimizer import register_optimizer_step_post_hook

WARMUP = int(os.environ.get("STEPTIMER_WARMUP", "20"))
stamps: list[float] = []
cpu: list[float] = []  # the process's CPU time (every thread) at each step


RANK = os.environ.get("RANK", "0")
LOG = os.environ.get("STEPTIMER_DIR")
steps_log = open(os.path.join(LOG, f"steps_{RANK}"), "a", buffering=1) if LOG else None  # noqa: SIM115 (to the end)
if LOG:
    with open(os.path.join(LOG, f"pid_{RANK}"), "w") as f:
        f.write(str(os.getpid()))


def after_step(_optimizer, _args, _kwargs) -> None:
    stamps.append(time.perf_counter())
    cpu.append(time.process_time())
    if steps_log is not None:
        steps_log.write(f"{time.time():.6f}\n")


def report() -> None:
    gaps = [b - a for a, b in zip(stamps[WARMUP:], stamps[WARMUP + 1:])]
    spent = [b - a for a, b in zip(cpu[WARMUP:], cpu[WARMUP + 1:])]
    if gaps and RANK == "0":
        print(f"median step time: {statistics.median(gaps) * 1e3:.3f} ms ({len(gaps)} steps timed), "
              f"CPU time per step: {statistics.median(spent) * 1e3:.3f} ms", flush=True)


register_optimizer_step_post_hook(after_step)
atexit.register(report)
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
