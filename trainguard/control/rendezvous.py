"""The scheduler's rendezvous requests: join (forming generations), agree and the torch store.

A collaborator of `Scheduler` (scheduler.py): it keeps the agreements and their decisions, and reaches the
scheduler only through its public face (`Core`): the cluster, the key-value data, the events, the status
view, the check that a node is current, and the condition every blocking request waits on. Each request
is fenced by generation, so a stale worker never joins or reads a newer group.
"""

from __future__ import annotations

import logging
import time

from . import formation as fm
from . import membership as m
from . import protocol as p
from .core import SchedulerCore
from .decisions import decide_agreement, raised_again
from .outcomes import Decided, FinishDecision, RestoreDecision
from .reports import ErrorReport, Report

log = logging.getLogger("trainguard.scheduler")
MAX_RAISED = 1024  # script errors remembered, to tell one raised again at the same step (decisions.raised_again)


class Rendezvous:
    def __init__(self, core: SchedulerCore):
        self.core = core
        self._agreements: dict[tuple[int, str], dict[int, Report]] = {}
        self._decisions: dict[tuple[int, str], Decided] = {}
        self._known_step = 0  # the newest step a restore decision named (the heartbeats tell the rest)
        self._raised: dict[tuple[str, int], tuple[int, int]] = {}  # an error's (signature, step): (rank, generation)

    async def on_join(self, req: p.Join):
        core = self.core
        c = core.cluster
        deadline = time.monotonic() + req.timeout
        while True:
            over = core.job_over()
            if over:
                return over
            node = core.current(req.node_id, req.incarnation)
            if isinstance(node, p.Error):
                return node
            if c.formed and c.generation > req.after:
                return self._formed_reply(node)
            if req.after > c.generation:  # waiting would never end: with this generation formed, it would spin
                return p.Error(code=p.ErrorCode.BAD_MESSAGE, message=fm.unknown_generation(c, req.after))
            never = fm.never_forms(c)
            if never:  # a peer already finished and left: waiting for it would last the whole join timeout
                return p.Error(code=p.ErrorCode.JOB_OVER, message=never)
            if c.formed and c.generation == req.after:
                m.bump_generation(c)  # this member has left the formed generation
                core.persist()
                core.events.emit("generation_bumped", generation=c.generation, by=node.node_id)
            c.joined.add(node.node_id)
            if self.try_form():
                continue
            gen = c.generation
            changed = await core.wait(lambda: c.formed or c.generation != gen or core.job_over() is not None
                                       or node.node_id not in c.joined, deadline)
            if not changed:
                return p.Error(code=p.ErrorCode.TIMEOUT, message=(
                    f"waited {req.timeout:g} s for generation {c.generation} to form; "
                    f"missing: {fm.missing_for_formation(c)}"), retry=True)

    def try_form(self) -> bool:
        """Form the pending generation if membership allows it now (elastic: maybe smaller)."""
        core = self.core
        c = core.cluster
        if not fm.try_form(c, time.monotonic(), core.elastic_deadline):
            return False
        core.persist()
        core.kv.keep_only(c.generation)
        size = fm.generation_size(c)
        log.info("generation %d formed with %d workers", c.generation, size)
        core.events.emit("generation_formed", generation=c.generation, world_size=size, members=list(c.members))
        core.notify()
        return True

    def _formed_reply(self, node: m.Node) -> p.Formed:
        c = self.core.cluster  # ranks in the generation: fixed ranks, or 0..n-1 in their order in a smaller one
        members = [p.Member(node_id=n.node_id, rank=i, host=n.host, pid=n.pid, incarnation=n.incarnation)
                   for i, n in enumerate(c.nodes[x] for x in fm.generation_members(c))]
        return p.Formed(generation=c.generation, rank=fm.generation_rank(c, node.node_id),
                        world_size=fm.generation_size(c), local_rank=m.local_rank_of(c, node), members=members)

    async def on_agree(self, req: p.Agree):
        core = self.core
        c = core.cluster
        node = core.current(req.node_id, req.incarnation)
        if isinstance(node, p.Error):
            return node
        key = (req.generation, req.purpose)
        fenced = p.Error(code=p.ErrorCode.FENCED, retry=True, message=(
            f"generation {req.generation} is over (now {c.generation}); rejoin"))
        if isinstance(req.payload, ErrorReport):  # before the fence: a rank that raised alone is often fenced (its
            # peers' failed collectives moved the job on), and its error still counts
            if (again := raised_again(self._raised, req.payload, node.rank, req.generation)) is not None:
                log.error("rank %d: %s: %s", node.rank, req.payload.signature, again.reason)
                return p.Agreed(decision=again)
            if len(self._raised) < MAX_RAISED:  # members only (authenticated): bounded all the same
                self._raised.setdefault((req.payload.signature, req.payload.step), (node.rank, req.generation))
        if req.generation != c.generation or not c.formed:
            return fenced
        got = self._agreements.setdefault(key, {})
        got[fm.generation_rank(c, node.node_id)] = req.payload
        if len(got) == fm.generation_size(c) and key not in self._decisions:
            decision = decide_agreement(req.purpose, got, max(self._known_step, core.view.job_step(), c.committed))
            if isinstance(decision, RestoreDecision) and decision.step is not None:
                self._known_step = max(self._known_step, decision.step)
            self._decisions[key] = decision
            if core.elastic and isinstance(decision, FinishDecision) and decision.ok:
                core.elastic.finishing(c)
            said = decision.for_event() if isinstance(decision, RestoreDecision) else {}
            core.events.emit(f"agreed_{req.purpose}", generation=req.generation, **said)
            core.notify()
        ok = await core.wait(lambda: key in self._decisions or c.generation != req.generation
                             or core.job_over() is not None, time.monotonic() + req.timeout)
        if key in self._decisions:
            return p.Agreed(decision=self._decisions[key])
        if not ok:
            have = sorted(got)
            return p.Error(code=p.ErrorCode.TIMEOUT, retry=True, message=(
                f"waited {req.timeout:g} s to agree on {req.purpose}; ranks reported: {have}"))
        return core.job_over() or fenced

    def on_store(self, req: p.StoreOp):
        """The reply, or (a get or wait for keys not set yet) a coroutine that waits for them."""
        c = self.core.cluster
        if req.generation != c.generation:
            return p.Error(code=p.ErrorCode.FENCED, retry=True, message=(
                f"store access for generation {req.generation} refused (now {c.generation})"))
        node, members = c.nodes.get(req.node_id or ""), fm.generation_members(c)
        if node is None or node.incarnation != req.incarnation or req.node_id not in members or \
                node.state not in (m.NodeState.ALIVE, m.NodeState.UNKNOWN):
            return p.Error(code=p.ErrorCode.FENCED, message=(
                f"the store of generation {req.generation} is for its members; {req.node_id!r} incarnation "
                f"{req.incarnation} is not one (members: {', '.join(members)[:200]})"))
        if req.op in ("get", "wait") and not self.core.kv.has(req.generation, req.keys):
            return self._store_wait(req)
        return self._store_apply(req)

    async def _store_wait(self, req: p.StoreOp):
        core, keys = self.core, req.keys
        c = core.cluster
        ok = await core.wait(lambda: core.kv.has(req.generation, keys) or c.generation != req.generation,
                             time.monotonic() + req.timeout)
        if c.generation != req.generation:
            return p.Error(code=p.ErrorCode.FENCED, retry=True, message="generation changed during a store wait")
        if not ok:
            return p.Error(code=p.ErrorCode.TIMEOUT, message=f"store keys not set within {req.timeout:g} s: {keys}")
        return self._store_apply(req)

    def _store_apply(self, req: p.StoreOp):
        reply = self.core.kv.apply(req)
        if req.op in ("set", "add", "compare_set", "delete"):
            self.core.notify()
        return reply
