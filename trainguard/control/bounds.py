"""Ranges that depend on the job: a request whose fields are each within their static range
(msgbase.py) but name a node rank or shard this job cannot have. A pure function of the request and
the job's worker count; the scheduler answers what it returns as a BAD_MESSAGE error."""

from __future__ import annotations

from . import protocol as p
from .reports import ShardedRestoreReport


def outside_job(req: p.Msg, worker_num: int) -> str | None:
    """Why `req` cannot come from a member of a job of `worker_num` workers (the field, its range, the
    value), or None."""
    if isinstance(req, (p.AgentSync, p.AgentPlace)):
        return _rank(f"{req.type}.agent (a node rank)", req.agent, worker_num)
    if isinstance(req, p.Agree) and isinstance(req.payload, ShardedRestoreReport):
        report = req.payload
        found = [_rank("agree.payload.shard", report.shard, worker_num)]
        found += [_rank("agree.payload.memory (a shard)", int(key), worker_num) for key in report.memory]
        return next((why for why in found if why), None)
    return None


def _rank(field: str, value: int, worker_num: int) -> str | None:
    if value < worker_num:
        return None
    return (f"invalid message ({field}: {value} is outside 0..{worker_num - 1}, the ranks of this job of "
            f"{worker_num} workers (TG_WORKER_NUM); every process of a job must be started with the same worker count)")
