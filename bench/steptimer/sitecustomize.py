"""Time a training script's optimizer steps without wrapping it: with this folder on PYTHONPATH and STEPTIMER=1,
every Python process of the run imports this at its start (as `sitecustomize`) and torch's global optimizer-step
hook takes the time after every `step()` of any optimizer. The script itself is what the launcher is given, so
`trainguard run` preloads its imports into its zygote and hot spares as it would for a user (a wrapper script in
front of it hid them: a replacement of the transformers example then imported transformers after the kill, 3.6 s).

    STEPTIMER=1 PYTHONPATH=bench/steptimer torchrun --nproc-per-node 3 SCRIPT ARGS
    STEPTIMER=1 PYTHONPATH=bench/steptimer trainguard run --workers 3 SCRIPT ARGS

At exit, rank 0 prints `median step time: X ms (N steps timed), CPU time per step: Y ms` (the median of the
process's CPU time, all threads, between steps: the cost where the wall time also holds waits for the other ranks
and the machine). A process takes its rank from RANK at its first step (a hot spare learns it when it becomes a
worker). Env: STEPTIMER_WARMUP (steps left out at the start, default 20); STEPTIMER_DIR (bench/framework_mttr.py):
each process writes DIR/pid_<rank> at its first step and appends the wall-clock time of each of its steps to
DIR/steps_<rank>.
"""

import atexit
import os
import statistics
import time

if os.environ.get("STEPTIMER") == "1":
    from torch.optim.optimizer import register_optimizer_step_post_hook

    WARMUP = int(os.environ.get("STEPTIMER_WARMUP", "20"))
    stamps: list[float] = []
    cpu: list[float] = []  # the process's CPU time (every thread) at each step
    log: list = []  # [rank, the steps file] once the first step is made

    def after_step(_optimizer, _args, _kwargs) -> None:
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())
        folder = os.environ.get("STEPTIMER_DIR")
        if not log:
            rank = os.environ.get("RANK", "0")
            log.extend([rank, open(os.path.join(folder, f"steps_{rank}"), "a", buffering=1) if folder else None])  # noqa: SIM115
            if folder:
                with open(os.path.join(folder, f"pid_{rank}"), "w") as f:
                    f.write(str(os.getpid()))
        if log[1] is not None:
            log[1].write(f"{time.time():.6f}\n")

    def report() -> None:
        gaps = [b - a for a, b in zip(stamps[WARMUP:], stamps[WARMUP + 1:])]
        spent = [b - a for a, b in zip(cpu[WARMUP:], cpu[WARMUP + 1:])]
        if gaps and log and log[0] == "0":
            print(f"median step time: {statistics.median(gaps) * 1e3:.3f} ms ({len(gaps)} steps timed), "
                  f"CPU time per step: {statistics.median(spent) * 1e3:.3f} ms", flush=True)

    register_optimizer_step_post_hook(after_step)
    atexit.register(report)
