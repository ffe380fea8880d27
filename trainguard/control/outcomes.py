"""What an agreement decides (protocol.Agreed), one model per purpose, shared by the scheduler's plans
(restore_plan.py, shard_plan.py, decisions.py) and the workers that act on them (train/engine/recovery.py,
train/parallel/livecopies.py, worker/runtime.py).

`purpose` tells the models apart on the wire; a worker reads the fields, never a key it guesses.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from ..config import MAX_WORKER_NUM
from .msgbase import Int64, Msg, NodeRank, Step, Text


class SourceKind(str, Enum):
    """Where a rank takes the state of the agreed step from."""

    SELF = "self"  # its own live state is at the step
    MEMORY = "memory"  # its own in-memory copy of its shard (sharded jobs)
    PEER = "peer"  # a peer sends it: a live state (or replica), or the peer's in-memory copy
    DISK = "disk"  # the checkpoint on disk
    INIT = "init"  # a fresh job: rank 0's parameters and seed


class CopyKind(str, Enum):
    """What a peer sends from."""

    LIVE = "live"
    MEMORY = "memory"


class Source(Msg):
    kind: SourceKind
    peer: NodeRank | None = None  # the sender, for PEER
    origin: CopyKind | None = None  # what the sender sends from, for PEER in a sharded job

    @model_validator(mode="after")
    def _peer_only_for_peer(self):
        if (self.kind is SourceKind.PEER) != (self.peer is not None) or (self.origin and self.peer is None):
            raise ValueError("a peer (and what it sends from) is named for a PEER source, and only for one")
        return self

    def words(self) -> str:
        """How a log line says where the state came from."""
        if self.kind is SourceKind.PEER:
            what = {CopyKind.LIVE: "'s live replica", CopyKind.MEMORY: "'s in-memory copy", None: ""}[self.origin]
            return f"rank {self.peer}{what}"
        return {SourceKind.SELF: "its own state", SourceKind.MEMORY: "its own in-memory copy",
                SourceKind.DISK: "the checkpoint on disk", SourceKind.INIT: "a fresh start"}[self.kind]


class RestoreDecision(Msg):
    """The step every rank resumes at and, for each rank (index = rank), where its state comes from.

    `step` is None only with `error`: no step can be restored, and the job must fail rather than start over.
    `from_step` is the newest step the job had reached; `from_step - step` steps are redone."""

    purpose: Literal["restore"] = "restore"
    step: Step | None
    fresh: bool = False
    from_step: Step | None = None
    sources: list[Source] = Field(default_factory=list, max_length=MAX_WORKER_NUM)
    error: Text | None = None

    @model_validator(mode="after")
    def _a_step_or_an_error(self):
        if (self.step is None) != (self.error is not None) or (self.error is not None and self.sources):
            raise ValueError("a restore decision names a step and every rank's source, or an error and no source")
        if any(s.peer is not None and s.peer >= len(self.sources) for s in self.sources):
            raise ValueError("a source names a peer outside the ranks of the decision")
        return self

    @property
    def lost_steps(self) -> int:
        if self.step is None or self.from_step is None:
            return 0
        return max(0, self.from_step - self.step)

    def source(self, rank: int) -> Source:
        return self.sources[rank]

    def served_by(self, rank: int) -> list[int]:
        """The ranks `rank` sends its state to, in rank order."""
        return [r for r, src in enumerate(self.sources) if src.kind is SourceKind.PEER and src.peer == rank]

    def for_event(self) -> dict:
        """The decision as events.jsonl keeps it (obs/events.py reads `sources` as rank -> {kind, peer})."""
        out: dict = {"step": self.step, "from_step": self.from_step}
        if self.error is not None:
            out["error"] = self.error
        if self.sources:
            out["sources"] = {str(r): s.model_dump(mode="json", exclude_none=True) for r, s in enumerate(self.sources)}
        return out


def failed_restore(error: str, from_step: int | None) -> RestoreDecision:
    return RestoreDecision(step=None, from_step=from_step, error=error)


class ErrorDecision(Msg):
    """Every rank raised the same error at the same step, or a rank raised again what a rank raised at the same step
    before the job resumed there: deterministic, the job ends at once. `reason` says which, for the error's line."""

    purpose: Literal["error"] = "error"
    same: bool
    signatures: list[Annotated[str, Field(max_length=1024)]] = Field(max_length=8)
    reason: Annotated[str, Field(max_length=300)] = ""


class FinishDecision(Msg):
    """Every rank reached the end: ok when they all end at one step."""

    purpose: Literal["finish"] = "finish"
    ok: bool
    steps: list[Int64] = Field(max_length=MAX_WORKER_NUM)  # -1: a rank that never trained


Decided = RestoreDecision | ErrorDecision | FinishDecision
Decision = Annotated[Union[RestoreDecision, ErrorDecision, FinishDecision], Field(discriminator="purpose")]
