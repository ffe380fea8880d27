"""`trainguard chaos`: inject a fault into a running job from outside it.

    trainguard chaos --sched-host H --sched-port P kill|term|stop|usr1 --rank R
    trainguard chaos --sched-host H --sched-port P kill-scheduler

The scheduler answers only a process that holds the job secret: set TG_JOB_SECRET_FILE (`trainguard
run` writes it to <recovery path>/job.secret) or TG_JOB_SECRET.

It asks the scheduler for its status (every member's rank, host, pid and state) and signals
the process: kill = SIGKILL (a crash), term = SIGTERM (a graceful exit of the whole job),
stop = SIGSTOP (a hang), usr1 = SIGUSR1 (Slurm's warning before a requeue). The target must
run on this host. Choosing the target is a pure function, `pick_target`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from ..config import read_secret, this_host
from ..errors import ConfigError, TrainguardError

ACTIONS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP, "usr1": signal.SIGUSR1}


def add_parser(sub) -> None:
    chaos = sub.add_parser("chaos", help="inject a fault into a running job (kill, term, stop a rank; kill the scheduler)")
    chaos.add_argument("--sched-host", "--master-addr", dest="sched_host", default="127.0.0.1",
                       help="the job's scheduler address (default 127.0.0.1)")
    chaos.add_argument("--sched-port", "--master-port", dest="sched_port", type=int, required=True,
                       help="the job's scheduler port")
    chaos.add_argument("action", choices=[*ACTIONS, "kill-scheduler"])
    chaos.add_argument("--rank", type=int, help="the worker's rank (for kill, term, stop, usr1)")
    chaos.set_defaults(handler=run)


def pick_target(status: dict, action: str, rank: int | None, host: str) -> tuple[int, str]:
    """(pid, description) of the process `action` hits; ConfigError saying why there is none."""
    if action == "kill-scheduler":
        return int(status["scheduler_pid"]), f"the scheduler (pid {status['scheduler_pid']})"
    if rank is None:
        raise ConfigError(f"chaos {action} needs --rank R")
    nodes = [n for n in status.get("nodes", []) if n.get("state") in ("alive", "unknown")]
    match = [n for n in nodes if int(n.get("rank", -1)) == rank]
    if not match:
        live = sorted(int(n["rank"]) for n in nodes if int(n.get("rank", -1)) >= 0)
        raise ConfigError(f"no live worker has rank {rank} (live ranks: {live or 'none'}; job "
                          f"{status.get('job', '?')}, generation {status.get('generation', '?')})")
    node = match[0]
    if node.get("host") != host:
        raise ConfigError(f"rank {rank} runs on host {node.get('host')!r}, not on this one ({host!r}); "
                          "run trainguard chaos there")
    return int(node["pid"]), f"rank {rank} (node {node['node_id']}, pid {node['pid']})"


def run(args: argparse.Namespace) -> int:
    from ..control.client import query_status  # lazy: the CLI starts without the client

    try:
        status = query_status((args.sched_host, args.sched_port), timeout=5.0, secret=read_secret(os.environ))
    except (TrainguardError, OSError) as exc:
        raise ConfigError(f"cannot get the job's status from {args.sched_host}:{args.sched_port}: {exc}") from None
    pid, who = pick_target(status, args.action, args.rank, this_host())
    sig = signal.SIGKILL if args.action == "kill-scheduler" else ACTIONS[args.action]
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        raise ConfigError(f"{who} is gone already") from None
    except PermissionError:
        raise ConfigError(f"not allowed to signal {who}; run as its user") from None
    print(f"trainguard chaos: sent {signal.Signals(sig).name} to {who}", file=sys.stderr)
    return 0
