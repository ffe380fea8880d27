"""Running the scheduler: as this process (`trainguard scheduler`, the child of an agent or of torchrun's
rank 0), or in a thread of this process (tests, benchmarks)."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading

from ..config import ClusterConfig
from ..errors import ClusterStateError, ConfigError
from ..exitcodes import EXIT_CONFIG
from .sched_child import die_with_parent
from .scheduler import Scheduler

FULL_GC_EVERY = 100  # younger collections per full one (Python's default: 10)


def tune_gc() -> None:
    """For a process whose heap is mostly long-lived (the scheduler: members and their connections; the
    simulated clients of bench/scheduler_scale.py). What exists now (modules, pydantic's schemas) is frozen
    out of every collection, and a full collection waits for 100 younger ones instead of 10. At Python's
    defaults one run of a 10,000-worker storm logged six full collections of 50-300 ms, each freeing next to
    nothing and each a stall of every heartbeat in flight (later runs, on a less loaded machine, did not
    show them). Cyclic garbage (a closed connection) is still collected, by the next full collection at
    the latest."""
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_GC_EVERY)


def run_scheduler(cfg: ClusterConfig, *, port_fd: int | None = None, parent_pid: int | None = None) -> int:
    """Run the scheduler in this process until the job ends. Exit codes (exitcodes.py): EXIT_CONFIG, refused at start
    (config, cluster.db, TLS files); EXIT_JOB_FAILED, the job failed; EXIT_PREEMPTED, stopped by a signal.
    `port_fd`: write the bound port there; `parent_pid`: end when that process dies (sched_child.py)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s",
                        stream=sys.stderr)
    if parent_pid is not None:
        die_with_parent(parent_pid)
    tune_gc()  # this process is the scheduler's own (start_in_thread leaves its host process's collector alone)
    try:
        return asyncio.run(Scheduler(cfg, port_fd=port_fd).serve())
    except (ConfigError, ClusterStateError) as exc:  # refused at start: one clear line, no traceback
        print(f"trainguard scheduler: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG


def start_in_thread(cfg: ClusterConfig) -> tuple[Scheduler, threading.Thread]:
    """The scheduler in a thread of this process, for tests; returns once it listens. (Under torchrun and
    mpirun rank 0 runs it as a child process: sched_child.py.)"""
    sched = Scheduler(cfg)
    errors: list[BaseException] = []

    def main() -> None:
        try:
            asyncio.run(sched.serve())
        except BaseException as exc:  # reported to the starting thread below
            errors.append(exc)
            sched.ready.set()

    thread = threading.Thread(target=main, name="trainguard-scheduler", daemon=True)
    thread.start()
    sched.ready.wait()
    if errors:
        raise errors[0]
    return sched, thread
