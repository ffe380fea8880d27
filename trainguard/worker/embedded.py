"""The scheduler of a job started by torchrun or mpirun: a child process of rank 0 (control/sched_child.py).

Under torchrun without TG_SCHED_PORT, rank 0's scheduler binds port 0 and rank 0 publishes the port in torchrun's
own store, where the other ranks read it: no fixed port is needed.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta

import torch.distributed as dist

from .. import config as C
from ..errors import ConfigError

PORT_KEY = "trainguard/scheduler"


def scheduler_for(cfg: C.ClusterConfig):
    """(the scheduler child this process supervises or None, torchrun's store or None, the config with the
    scheduler's address). The store is returned to be kept: if this rank hosts it, it must outlive the call."""
    if cfg.embedded_scheduler:
        from ..control.sched_child import SchedulerProcess

        scheduler = SchedulerProcess(cfg)  # restarted if it dies; it ends with this rank's job
        hosted = dataclasses.replace(cfg, sched_port=scheduler.start())
        store = None
        if cfg.mode is C.LaunchMode.TORCHRUN and cfg.sched_port == 0:
            store = torchrun_store(cfg)
            store.set(PORT_KEY, f"{hosted.sched_host}:{hosted.sched_port}")
        return scheduler, store, hosted
    if cfg.mode is C.LaunchMode.TORCHRUN and cfg.sched_port == 0:
        host, port = torchrun_store(cfg).get(PORT_KEY).decode().rsplit(":", 1)
        return None, None, dataclasses.replace(cfg, sched_host=host, sched_port=int(port))
    return None, None, cfg


def torchrun_store(cfg: C.ClusterConfig) -> dist.TCPStore:
    """torchrun's own store (its master is rank 0's, unless torchrun's agent hosts it)."""
    port = os.environ.get(C.TORCHRUN_PORT, "")
    if not port.isdigit():
        raise ConfigError(f"{C.TORCHRUN_PORT}={port!r}: torchrun mode needs it (or set TG_SCHED_PORT)")
    is_master = cfg.embedded_scheduler and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "") != "True"
    return dist.TCPStore(cfg.sched_host, int(port), is_master=is_master, wait_for_workers=False,
                         timeout=timedelta(seconds=cfg.connect_timeout))
