"""A script's own `torch.distributed.init_process_group()` joins trainguard's group (under `trainguard run`).

Scripts written for torchrun, and the frameworks (Lightning, Accelerate, the transformers Trainer), build
the default group themselves. Under `trainguard run` that call must not build a second group, one that no
generation fences and no recovery rebuilds: it joins this process's trainguard runtime instead
(`trainguard.init()`), whose default group is the one the script then uses with `dist.*`. Run again after a
rewind, the call joins the next generation, as `trainguard.init()` does. Arguments that contradict the job
(another rank or world size, a backend the job does not use) are a `ConfigError` naming the fix; a rendezvous
of the script's own (`init_method`, `store`, MASTER_ADDR) is not needed and is ignored.

The worker entry (launch/worker_main.py) installs the wrapper before the script runs, or as soon as
torch.distributed is imported. This module imports nothing of torch but what is already loaded then.
"""

from __future__ import annotations

import functools
import sys

from ..errors import ConfigError
from . import generators

C10D = "torch.distributed.distributed_c10d"
_original = None


def install() -> None:
    """Replace init_process_group in torch.distributed (and its c10d module) by `join`; once per process."""
    global _original
    generators.install()  # the script's own torch.Generators, keyed at every commit (worker/generators.py)
    c10d = sys.modules[C10D]
    if _original is not None or getattr(c10d.init_process_group, "__trainguard_wrapped__", False):
        return
    _original = c10d.init_process_group
    wrapped = functools.wraps(_original)(join)
    wrapped.__trainguard_wrapped__ = True
    c10d.init_process_group = wrapped
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "init_process_group", None) is _original:
        dist.init_process_group = wrapped  # else torch.distributed's own `from .distributed_c10d import *` copies it
    refuse_spawned_ranks(sys.modules.get("torch.multiprocessing"))


def refuse_spawned_ranks(mp) -> None:
    """`torch.multiprocessing.spawn()` (and `start_processes`) before the job's group is joined: a script that starts
    its ranks itself (pytorch/examples' imagenet, MoCo and SimSiam with `--multiprocessing-distributed`). Under
    `trainguard run` each rank is already a process of the job; the spawned ones are nobody's ranks (their
    `init_process_group` found a rendezvous of their own, their `trainguard.DDP` no job), and their failure reached
    the launcher as the worker's exit 1, restarted until it gave up. A ConfigError here ends the job at once."""
    if mp is None:
        return
    for name in ("spawn", "start_processes"):
        original = getattr(mp, name, None)
        if original is None or getattr(original, "__trainguard_wrapped__", False):
            continue
        refusing = functools.wraps(original)(functools.partial(_refuse_before_join, original))
        refusing.__trainguard_wrapped__ = True
        setattr(mp, name, refusing)


def _refuse_before_join(original, *args, **kwargs):
    if not sys.modules[C10D].is_initialized():
        raise ConfigError("torch.multiprocessing.spawn() before the job's group is joined: under `trainguard run` "
                          "every rank is already a process of the job (`--workers N` on each host), so the script must "
                          "not start its ranks itself; call the rank's function directly in this process (for "
                          "pytorch/examples' imagenet: leave out --multiprocessing-distributed, --world-size and "
                          "--rank, and give --dist-url env://, so that it reads the job's RANK and WORLD_SIZE), and "
                          "give the number of ranks to `trainguard run --workers`")
    return original(*args, **kwargs)


def check_request(backend, world_size, rank, *, job_backend: str, job_world: int, job_rank: int) -> None:
    """ConfigError where the script's arguments contradict the job (pure)."""
    if world_size not in (None, -1) and world_size != job_world:
        raise ConfigError(f"init_process_group(world_size={world_size}), but this trainguard job has {job_world} "
                          "workers: leave world_size out (or read WORLD_SIZE), or start the job with "
                          f"`trainguard run --workers {world_size}`")
    if rank not in (None, -1) and rank != job_rank:
        raise ConfigError(f"init_process_group(rank={rank}), but trainguard gave this process rank {job_rank}: "
                          "leave rank out (or read RANK)")
    if isinstance(backend, str) and backend and backend.lower() != "undefined":
        named = {part.split(":")[-1].strip().lower() for part in backend.split(",")}
        if job_backend not in named:
            raise ConfigError(f"init_process_group(backend={backend!r}), but this job's group uses {job_backend}: "
                              f"set TG_BACKEND={sorted(named)[0]} for the job, or leave backend out")


def join(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None, group_name="",
         pg_options=None, device_id=None):
    """torch's init_process_group under `trainguard run`: join this process's trainguard runtime instead."""
    from . import runtime

    rt = runtime.init()
    check_request(backend, world_size, rank, job_backend=rt.backend, job_world=rt.world_size, job_rank=rt.rank)
    watch_first_step(rt.rank)


_watching = False


def watch_first_step(rank: int) -> None:
    """Rank 0 says so if the script's first optimizer step finds no trainguard state in the process
    (frameworks.unguarded: a script that joined the job through its own init_process_group but was not ported).
    One global optimizer hook, removed at that first step: nothing on the steps after it. Once per process."""
    global _watching
    if _watching:
        return
    _watching = True
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from .. import rewinding
    from ..frameworks import unguarded

    def first_step(optimizer, args, kwargs) -> None:
        if rewinding.protected(optimizer) and not rewinding.protected():
            return  # a wrapped optimizer stepped before the loop (a state dict made): watch on
        handle.remove()
        if rank == 0 and not rewinding.protected():
            print(unguarded(sys.modules), file=sys.stderr, flush=True)

    handle = register_optimizer_step_pre_hook(first_step)
