"""cluster.db at scale: only changed rows are written, one commit covers a pass of the event loop, and
nothing the scheduler acknowledged is lost when it is killed in the middle of a registration storm.
(The figures for 10,000 workers come from bench/scheduler_scale.py.)"""

from __future__ import annotations

import asyncio
import shutil

import pytest

from trainguard.config import ClusterConfig, LaunchMode, Role
from trainguard.control import membership as m
from trainguard.control import protocol as p
from trainguard.control.db import ClusterDB
from trainguard.control.sched_main import start_in_thread
from trainguard.testing.simworkers import SchedulerUnderTest, SimWorker

SECRET = b"a secret for the scale tests, 32+ chars"


def _node(i: int, state=m.NodeState.ALIVE) -> m.Node:
    return m.Node(str(i), i, "host", 100 + i, 1, state, 0.0)


def test_save_writes_only_what_changed_and_reloads_the_same(tmp_path):
    db = ClusterDB(tmp_path)
    cluster = m.Cluster(worker_num=50)
    for i in range(50):
        cluster.nodes[str(i)] = _node(i)
    assert db.save(cluster) == 50 + 8  # every node, every meta key
    assert db.save(cluster) == 0  # nothing changed: no transaction at all
    cluster.nodes["7"].state = m.NodeState.DEAD
    cluster.nodes["7"].failures = 1
    assert db.save(cluster, {"7"}) == 1  # the scheduler names the rows a request touched
    cluster.nodes.pop("3")  # a replacement under a new id takes its place
    cluster.nodes["x3"] = m.Node("x3", 3, "other", 999, 2, m.NodeState.ALIVE, 0.0)
    cluster.generation += 1
    assert db.save(cluster, {"3", "x3"}) == 3  # one row deleted, one written, the generation
    cluster.nodes["9"].pid = 4242
    assert db.save(cluster) == 1  # none named: every row is compared
    cluster.committed = 120  # the job's step (scheduler._keep_step): a rerun after every process died reads it
    assert db.save(cluster, set()) == 1
    db.close()
    again = ClusterDB(tmp_path).load()
    assert again.generation == cluster.generation and sorted(again.nodes) == sorted(cluster.nodes)
    assert again.committed == 120
    assert again.nodes["7"].state is m.NodeState.DEAD and again.nodes["7"].failures == 1
    assert again.nodes["x3"].host == "other" and again.nodes["x3"].incarnation == 2


async def _register(workers: list[SimWorker], port: int, n: int, acked: list[str], *, finish: bool = False,
                    on_ack=None) -> None:
    async def one(w: SimWorker) -> None:
        await w.connect("127.0.0.1", port, SECRET)
        reply = await w.register(n)
        assert isinstance(reply, p.Registered), reply
        acked.append(w.node_id)
        if on_ack is not None:
            on_ack(len(acked))
        if finish:  # done: the job ends when all have said so, and the scheduler with it
            while len(acked) < n:
                await asyncio.sleep(0.01)
            assert isinstance(await w.finish(), p.Ok)

    try:
        await asyncio.gather(*(one(w) for w in workers), return_exceptions=True)
    finally:
        for w in workers:
            w.close()


def test_a_registration_storm_shares_commits(tmp_path):
    n = 300
    cfg = ClusterConfig(role=Role.SCHEDULER, mode=LaunchMode.DYNAMIC, sched_host="127.0.0.1", sched_port=0,
                        worker_num=n, secret=SECRET, enable_recovery=True, recovery_path=tmp_path)
    sched, thread = start_in_thread(cfg)
    workers = [SimWorker(str(i)) for i in range(n)]
    acked: list[str] = []
    asyncio.run(_register(workers, sched.port, n, acked, finish=True))
    thread.join(30)
    assert not thread.is_alive() and sched.cluster.job is m.JobState.DONE
    assert len(acked) == n
    # one commit per pass of the loop, not per registration (each was acknowledged after its commit)
    assert 1 <= sched.commits.commits < n / 3, sched.commits.commits
    db = ClusterDB(tmp_path)  # a second reader sees all of them committed, and the job's end
    try:
        saved = db.load()
        assert saved.job is m.JobState.DONE and sorted(saved.nodes) == sorted(str(i) for i in range(n))
    finally:
        db.close()


@pytest.mark.timeout(120)
def test_kill_9_mid_storm_loses_no_acknowledged_registration(tmp_path):
    # the kill comes once 1 in 20 is acknowledged: the clients read replies slower than the scheduler sends
    # them, so by a later count it may already have answered every one (then the test would prove nothing)
    n, kill_at = 1000, 50
    secret_file = tmp_path / "job.secret"
    secret_file.write_bytes(SECRET)
    secret_file.chmod(0o600)
    recovery = tmp_path / "recovery"
    recovery.mkdir()
    sched = SchedulerUnderTest(n, recovery, secret_file, log=tmp_path / "scheduler.log")
    workers = [SimWorker(str(i)) for i in range(n)]
    acked: list[str] = []

    def kill_at_the_50th(count: int) -> None:  # in the acknowledgement's own callback: no poller to wait for
        if count == kill_at:  # (a poller, on a busy machine, once ran only after all 1000 were acknowledged)
            sched.kill()  # SIGKILL while registrations are in flight

    try:
        asyncio.run(_register(workers, sched.port, n, acked, on_ack=kill_at_the_50th))
    finally:
        sched.kill()
    assert kill_at <= len(acked) < n, f"the kill came after the storm: the test proved nothing ({len(acked)} acked)"
    scratch = tmp_path / "copy"  # read a copy: reading must not change what a new scheduler would load
    scratch.mkdir()
    for name in ("cluster.db", "cluster.db-wal"):
        if (recovery / name).exists():
            shutil.copyfile(recovery / name, scratch / name)
    db = ClusterDB(scratch)
    try:
        saved = db.load().nodes
    finally:
        db.close()
    missing = sorted(set(acked) - set(saved))
    assert not missing, f"acknowledged but not in cluster.db: {missing}"


def test_a_failed_save_is_not_acknowledged_and_is_retried_in_full():
    """A full disk: whatever waits on that save gets its error (no reply leaves), and the next save, even with
    nothing new changed (the job's end), writes again comparing every row."""
    from trainguard.control.commit import GroupCommit

    calls: list[set[str] | None] = []

    def save(touched):
        calls.append(touched)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")

    async def main() -> None:
        commits = GroupCommit(save)
        commits.changed(["3"])
        with pytest.raises(OSError, match="No space left"):
            await commits.pending()
        commits.flush()  # nothing new changed; the failed save is retried
        assert calls == [{"3"}, None] and commits.commits == 1
        commits.flush()
        assert len(calls) == 2  # nothing to do now

    asyncio.run(main())


def test_after_a_failed_save_every_reply_waits_for_a_save_that_succeeds():
    """A connection asks `pending()` before each reply (control/conn.py). After a failed save a save is always
    due, even with nothing new changed, so no reply that may reveal the unsaved change leaves before it is saved."""
    from trainguard.control.commit import GroupCommit

    calls: list[set[str] | None] = []

    def save(touched):
        calls.append(touched)
        if len(calls) <= 2:
            raise OSError(28, "No space left on device")

    async def main() -> None:
        commits = GroupCommit(save)
        commits.changed(["3"])
        first = commits.pending()
        await asyncio.sleep(0)  # the save runs at the start of the loop's next pass
        assert isinstance(first.exception(), OSError)
        retry = commits.pending()  # nothing changed since, and still a save is due
        assert retry is not None and retry is not first
        await asyncio.sleep(0)
        assert isinstance(retry.exception(), OSError) and calls == [{"3"}, None]
        last = commits.pending()
        await asyncio.sleep(0)
        assert last.result() is None and calls == [{"3"}, None, None]
        assert commits.pending() is None  # saved: nothing is due any more

    asyncio.run(main())
