"""What each rank reports to an agreement (protocol.Agree), one model per purpose.

Each model has a required field the others lack (`disk`, `shard`, `signature`; a finish report has `step` alone
and no field more), so the payload's model follows from its fields, and Agree checks it is the purpose's own.
Every number is bounded: these reports reach the scheduler's decisions, its events and `trainguard status`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from .msgbase import Int64, Msg, NodeId, NodeRank, Step

MAX_DISK_STEPS = 4096  # checkpoints one rank may list (retention keeps a handful)
MAX_COPIES = 64  # in-memory copies one rank holds (its own shard and its ward's, a few steps each)
ShardKey = Annotated[str, Field(pattern=r"^[0-9]{1,7}$")]  # a shard index, as msgpack map keys are strings
Steps = Annotated[list[Step], Field(max_length=MAX_DISK_STEPS)]


class RestoreReport(Msg):
    """What a rank of a data-parallel job can restore from: its live state's step (None: a fresh process) and
    its complete disk checkpoints (restore_plan.py)."""

    step: Step | None
    disk: Steps
    node: NodeId | None = None


class ShardedRestoreReport(RestoreReport):
    """A rank of a sharded job (FSDP, HSDP, DP x TP) also says which shard it holds and the in-memory copies
    it keeps, shard -> steps (shard_plan.py). Its required `shard` tells it from a data-parallel report."""

    shard: NodeRank
    memory: dict[ShardKey, Steps] = Field(default_factory=dict, max_length=MAX_COPIES)


class FinishReport(Msg):
    step: Int64  # the step the rank ends at (-1 if it never trained)


class ErrorReport(Msg):
    """The error a rank raised, to learn whether every rank raised the same (exit at once: deterministic)."""

    signature: str = Field(max_length=1024)
    step: Int64


Report = RestoreReport | FinishReport | ErrorReport  # a sharded report is a RestoreReport
