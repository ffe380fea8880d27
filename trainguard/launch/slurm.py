"""What `trainguard run` learns from Slurm when srun starts it: one agent per task.

    srun --ntasks-per-node=1 trainguard run --workers 4 train.py

In a task of a job step (SLURM_STEP_ID, SLURM_PROCID, SLURM_STEP_NUM_TASKS set) the agent takes
--node-rank from SLURM_PROCID, --nnodes from SLURM_STEP_NUM_TASKS, --sched-host from the first host of
SLURM_STEP_NODELIST (task 0 runs there) and --sched-port from the job id (20000 + SLURM_JOB_ID % 12000,
the same on every node, below Linux's ephemeral ports). A flag, a job-file key or TG_SCHED_HOST /
TG_SCHED_PORT wins over these. A batch script itself (no step) is not a task: nothing is taken there.
"""

from __future__ import annotations

import re
from typing import Mapping

from ..errors import ConfigError

PORT_BASE, PORT_SPAN = 20000, 12000
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: "node[07-09,12],gpu1" -> "node07" (pure)."""
    text = nodelist.strip()
    depth, end = 0, len(text)
    for i, ch in enumerate(text):  # the first entry: up to a comma outside brackets
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    entry = text[:end]
    if "[" not in entry:
        if not entry:
            raise ConfigError(f"SLURM_STEP_NODELIST={nodelist!r} names no host")
        return entry
    prefix, rest = entry.split("[", 1)
    inside, _, suffix = rest.partition("]")
    first = _RANGE.match(inside.split(",", 1)[0].strip())
    if first is None or not prefix:
        raise ConfigError(f"SLURM_STEP_NODELIST={nodelist!r}: cannot read its first host; pass --sched-host")
    return prefix + first.group(1) + first_host(suffix) if "[" in suffix else prefix + first.group(1) + suffix


def defaults(env: Mapping[str, str]) -> dict[str, object]:
    """`trainguard run` flags from a Slurm step's environment, or {} outside one (pure)."""
    if not (env.get("SLURM_STEP_ID") and env.get("SLURM_PROCID") and env.get("SLURM_STEP_NUM_TASKS")):
        return {}
    try:
        rank, tasks = int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"])
        job = int(env.get("SLURM_JOB_ID", "0") or 0)
    except ValueError:
        raise ConfigError(f"SLURM_PROCID={env['SLURM_PROCID']!r}, SLURM_STEP_NUM_TASKS="
                          f"{env['SLURM_STEP_NUM_TASKS']!r}: expected integers (is this a Slurm task?)") from None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    found: dict[str, object] = {"nnodes": tasks, "node_rank": rank}
    if nodelist and not _given(env, "TG_SCHED_HOST", "MS_SCHED_HOST"):
        found["sched_host"] = first_host(nodelist)
    if job and not _given(env, "TG_SCHED_PORT", "MS_SCHED_PORT"):
        found["sched_port"] = PORT_BASE + job % PORT_SPAN
    return found


def _given(env: Mapping[str, str], *names: str) -> bool:
    return any(env.get(n, "").strip() for n in names)
