"""Clear errors, with nothing lost: refusals at start and at registration, fencing and quarantine.

Every case uses real processes on loopback. A refusal must name what is wrong and what to do,
must not change the persisted state, and must not disturb a job that is running.
"""

from __future__ import annotations

import re
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from harness import JOB, HandJob, env, events, free_port, wait_for

import trainguard as tg
from trainguard.control import membership as m
from trainguard.control import protocol as p
from trainguard.control.client import (
    Connection,
    Heartbeater,
    SchedulerClient,
    query_status,
    raise_for,
)
from trainguard.control.db import ClusterDB
from trainguard.errors import FencedError, RegistrationRejected

pytestmark = pytest.mark.timeout(120)

ELSEWHERE = "elsewhere.invalid"  # fake workers' host: the scheduler never kills a pid on another host
EXPECTED_STEPS = 32  # dp_job: 512 samples, batch 16, 2 ranks, 2 epochs


def sched_env(recovery: Path, port: int, workers: int, **extra: str) -> dict[str, str]:
    return env(TG_ROLE="scheduler", TG_SCHED_HOST="127.0.0.1", TG_SCHED_PORT=str(port), TG_WORKER_NUM=str(workers),
               TG_ENABLE_RECOVERY="1", TG_RECOVERY_PATH=str(recovery), **extra)


def run_cli_scheduler(recovery: Path, workers: int = 2, **extra: str) -> subprocess.CompletedProcess:
    """`trainguard scheduler` that is expected to refuse at once (it would otherwise wait for workers)."""
    return subprocess.run([sys.executable, "-m", "trainguard", "scheduler"], env=sched_env(recovery, free_port(),
                          workers, **extra), capture_output=True, text=True, timeout=30)


# a copy of a script that has already imported torch (as a hot spare has) and runs it once GATE exists,
# so that a test does not wait for an import at the moment it cares about
PRELOADED = """import os, runpy, sys, time
import torch
gate, sys.argv = sys.argv[1], sys.argv[2:]
while not os.path.exists(gate):
    time.sleep(0.02)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def preloaded(args: list[str], env: dict[str, str], gate: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-u", "-c", PRELOADED, str(gate), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def start_scheduler(job: HandJob) -> None:
    """The job's scheduler as `trainguard scheduler` (it imports no torch, so it starts fast)."""
    with open(job.out / "logs" / "sched.log", "a") as log:
        job.procs["sched"] = subprocess.Popen([sys.executable, "-m", "trainguard", "scheduler"],
                                              env=job._env("scheduler", None), stdout=log, stderr=subprocess.STDOUT)


def start_job(job: HandJob) -> None:
    start_scheduler(job)
    for i in range(job.workers):
        job.start(str(i))


def db_rows(recovery: Path, scratch: Path) -> tuple[list, list]:
    """cluster.db's rows, read from a copy so that reading cannot change the original."""
    scratch.mkdir()
    for name in ("cluster.db", "cluster.db-wal"):  # without -shm: sqlite rebuilds the WAL index
        if (recovery / name).exists():
            shutil.copyfile(recovery / name, scratch / name)
    conn = sqlite3.connect(scratch / "cluster.db")
    try:
        return sorted(conn.execute("SELECT * FROM meta")), sorted(conn.execute("SELECT * FROM nodes"))
    finally:
        conn.close()


def assert_undisturbed(out: Path, workers: int = 2) -> None:
    """The job ended as one that never failed: one generation, no failure, no rollback, same model everywhere."""
    ev = events(out)
    assert not [e for e in ev if e["event"] == "failure_detected"], ev
    assert [e["generation"] for e in ev if e["event"] == "generation_formed"] == [1]
    assert all(e.get("fresh") for e in ev if e["event"] == "restore_step")
    states = [tg.load_state(out / "final" / f"rank_{r}.safetensors") for r in range(workers)]
    for r, state in enumerate(states):
        assert int(state["steps"]) == EXPECTED_STEPS, f"rank {r} ran {state['steps']} steps"
        for name, tensor in state["model"].items():
            assert torch.equal(tensor, states[0]["model"][name]), f"rank {r}: {name} differs from rank 0"


# --- 1. a duplicate live node id ---------------------------------------------------------


def test_duplicate_live_node_id_is_rejected_and_the_job_finishes(tmp_path):
    job = HandJob(tmp_path, 2, free_port(), extra=("--step-sleep", "0.2"))
    gate = tmp_path / "start-duplicate"
    # the same script, started again as node 0 (its own heartbeat timeout bounds how long it insists)
    dup = preloaded(job.args, {**job._env("worker", "0"), "TG_HEARTBEAT_TIMEOUT": "1"}, gate)
    try:
        start_job(job)
        wait_for(lambda: any(e["event"] == "restore_step" for e in events(tmp_path)), 100, "training to start")
        gate.touch()
        out, err = dup.communicate(timeout=30)
        assert dup.returncode != 0, out + err[-3000:]
        assert "RegistrationRejected" in err and "node id '0' is already registered and alive" in err, err[-3000:]
        assert "incarnation 1" in err and "is still alive" in err and "stop that process first" in err, err[-3000:]
        assert job.procs["0"].poll() is None, "the original node 0 must still be running when the duplicate gives up"
        rejected = [e for e in events(tmp_path) if e["event"] == "register_rejected"]
        assert rejected and all(e["node"] == "0" and e["code"] == "duplicate" for e in rejected), rejected
        assert "still alive" in rejected[0]["reason"]
        assert "rejected registration of 0" in job.log("sched")
        codes = job.wait(90)
        assert codes == {"sched": 0, "0": 0, "1": 0}, {n: job.log(n)[-2000:] for n in codes}
        assert_undisturbed(tmp_path)
    finally:
        if dup.poll() is None:
            dup.kill()
            dup.communicate(timeout=10)
        job.close()


# --- 2. a restart with another TG_WORKER_NUM ---------------------------------------------


def test_scheduler_restart_with_another_worker_num_is_refused_and_changes_nothing(tmp_path):
    recovery = tmp_path / "recovery"
    job = HandJob(tmp_path, 2, free_port(), extra=("--step-sleep", "0.1"))
    gate = tmp_path / "start-wrong-scheduler"
    # the user's own script as the scheduler, as started by hand, with a wrong TG_WORKER_NUM
    wrong = preloaded(job.args, {**job._env("scheduler", None), "TG_WORKER_NUM": "3"}, gate)
    try:
        start_job(job)
        wait_for(lambda: any(e["event"] == "restore_step" for e in events(tmp_path)), 100, "training to start")
        job.kill("sched")  # SIGKILL: cluster.db still says the job is running
        before = db_rows(recovery, tmp_path / "before")
        assert ("job", "running") in before[0] and ("worker_num", "2") in before[0]

        gate.touch()
        out, msg = wrong.communicate(timeout=30)
        assert wrong.returncode == 2, out + msg
        assert str(recovery / "cluster.db") in msg and "2 workers" in msg and "TG_WORKER_NUM=3" in msg, msg
        assert "nothing was changed" in msg and "TG_WORKER_NUM=2" in msg, msg
        assert "Traceback" not in msg, msg
        assert db_rows(recovery, tmp_path / "after") == before

        # nothing lost: the right scheduler resumes the job and nobody rolls back
        start_scheduler(job)
        codes = job.wait(90)
        assert codes == {"sched": 0, "0": 0, "1": 0}, {n: job.log(n)[-2000:] for n in codes}
        assert "scheduler resumed" in job.log("sched")
        assert_undisturbed(tmp_path)
    finally:
        if wrong.poll() is None:
            wrong.kill()
            wrong.communicate(timeout=10)
        job.close()


# --- 3. a corrupt cluster.db ---------------------------------------------------------------


def _persisted_job(recovery: Path) -> None:
    """A cluster.db as a scheduler leaves it mid-job."""
    recovery.mkdir()
    db = ClusterDB(recovery)
    cluster = m.Cluster(worker_num=2, generation=3, formed=True)
    for i in range(2):
        cluster.nodes[str(i)] = m.Node(str(i), i, ELSEWHERE, 100 + i, 2, m.NodeState.ALIVE, 0.0)
    db.save(cluster)
    db.close()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_cluster_db_is_refused_and_left_as_it_is(tmp_path, damage):
    recovery = tmp_path / "recovery"
    _persisted_job(recovery)
    path = recovery / "cluster.db"
    good = path.read_bytes()
    path.write_bytes({"garbage": bytes(range(256)) * (len(good) // 256 + 1), "truncated": good[: len(good) // 2],
                      "empty": b""}[damage])
    damaged = path.read_bytes()
    listing = sorted(x.name for x in recovery.iterdir())

    proc = run_cli_scheduler(recovery)

    assert proc.returncode == 2, proc.stdout + proc.stderr
    msg = proc.stderr
    assert str(path) in msg and "corrupt" in msg and "nothing was changed" in msg and "move it aside" in msg, msg
    assert "Traceback" not in msg, msg
    assert path.read_bytes() == damaged  # no silent reset
    assert sorted(x.name for x in recovery.iterdir()) == listing


# --- 4. an unwritable recovery path ----------------------------------------------------------


@pytest.mark.timeout(240)
def test_unwritable_recovery_path_is_reported_at_start_by_every_entry_point(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    bad = blocker / "recovery"

    # the scheduler
    proc = run_cli_scheduler(bad)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "TG_RECOVERY_PATH" in proc.stderr and str(bad) in proc.stderr and "not writable" in proc.stderr
    assert "Traceback" not in proc.stderr

    # the launcher: refused before any process starts
    launcher = subprocess.run(
        [sys.executable, "-m", "trainguard", "run", "--workers", "2", "--recovery-path", str(bad), str(JOB),
         "--out", str(tmp_path / "final")], env=env(), capture_output=True, text=True, timeout=30)
    assert launcher.returncode == 2, launcher.stdout + launcher.stderr
    assert "TG_RECOVERY_PATH" in launcher.stderr and str(bad) in launcher.stderr
    assert "starting scheduler" not in launcher.stdout + launcher.stderr

    # a worker started by hand: told before it waits for any scheduler (none is running here)
    worker = env(TG_ROLE="worker", TG_SCHED_HOST="127.0.0.1", TG_SCHED_PORT=str(free_port()), TG_WORKER_NUM="2",
                 TG_NODE_ID="0", TG_ENABLE_RECOVERY="1", TG_RECOVERY_PATH=str(bad), TG_CONNECT_TIMEOUT="600")
    # a worker that waited for the scheduler would outlive this (connect timeout 600 s), however busy the machine
    proc = subprocess.run([sys.executable, "-u", str(JOB), "--out", str(tmp_path / "final")], env=worker,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode != 0
    assert "ConfigError" in proc.stderr and "TG_RECOVERY_PATH" in proc.stderr and str(bad) in proc.stderr, proc.stderr
    assert not blocker.is_dir() and blocker.read_text() == "not a directory"


# --- a scheduler process driven by hand-made workers (no torch) --------------------------------


class LiveScheduler:
    """A `trainguard scheduler` process, and fake workers that register and heartbeat like real ones."""

    def __init__(self, tmp_path: Path, workers: int = 2, **extra: str):
        self.recovery = tmp_path / "recovery"
        self.workers = workers
        self.port = free_port()
        self.address = ("127.0.0.1", self.port)
        self.log = open(tmp_path / "scheduler.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "trainguard", "scheduler"],
                                     env=sched_env(self.recovery, self.port, workers, **extra),
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.clients: list[SchedulerClient] = []
        self.hearts: list[Heartbeater] = []

    def client(self, connect_timeout: float = 20.0) -> SchedulerClient:
        c = SchedulerClient(self.address, connect_timeout=connect_timeout)
        self.clients.append(c)
        return c

    def worker(self, node_id: str, pid: int, connect_timeout: float = 20.0) -> tuple[SchedulerClient, Heartbeater]:
        """Register `node_id` and keep it alive with heartbeats, as the runtime does."""
        c = self.client(connect_timeout)
        c.register(node_id=node_id, host=ELSEWHERE, pid=pid, worker_num=self.workers)
        return c, self.heartbeat(c.identity)

    def heartbeat(self, identity) -> Heartbeater:
        hb = Heartbeater(self.address, identity, 0.2)
        hb.start()
        self.hearts.append(hb)
        return hb

    def node(self, node_id: str) -> dict:
        return next(n for n in query_status(self.address)["nodes"] if n["node_id"] == node_id)

    def die(self, hb: Heartbeater, node_id: str) -> None:
        """The process dies: its heartbeat connection closes without a goodbye."""
        assert hb.connected.wait(5), "the heartbeat never got through"
        hb.stop()
        wait_for(lambda: self.node(node_id)["state"] == "dead", 10, f"node {node_id} to be marked dead")

    def events(self) -> list[dict]:
        return events(self.recovery.parent)

    def close(self) -> None:
        for hb in self.hearts:
            hb.stop()
        for c in self.clients:
            c.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def join_all(*pairs: tuple[SchedulerClient, int]) -> list[p.Formed]:
    """Join concurrently (a join returns once every member has joined)."""
    results: list = [None] * len(pairs)

    def one(i: int, client: SchedulerClient, after: int) -> None:
        try:
            results[i] = client.join(after=after, timeout=10)
        except Exception as exc:  # handed to the test thread below
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i, c, a)) for i, (c, a) in enumerate(pairs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for r in results:
        if not isinstance(r, p.Formed):
            raise AssertionError(f"join failed: {r!r}")
    return results


# --- 5. fencing --------------------------------------------------------------------------------


def test_stale_incarnation_and_stale_generation_are_fenced(tmp_path, caplog):
    cl = LiveScheduler(tmp_path)
    try:
        c0, hb0 = cl.worker("0", 100)
        c1, hb1 = cl.worker("1", 101)
        assert [f.generation for f in join_all((c0, 0), (c1, 0))] == [1, 1]

        cl.die(hb1, "1")  # incarnation 1 of node 1 is gone; generation 1 is over
        c1b, _ = cl.worker("1", 102)
        assert c1b.identity.incarnation == 2

        # a stale incarnation: heartbeat, failure report and join of incarnation 1 are refused
        conn = Connection(cl.address, timeout=5)
        try:
            stale = [p.Heartbeat(node_id="1", incarnation=1, generation=1, step=5),
                     p.ReportFailure(node_id="1", incarnation=1, generation=1, kind=p.FailureKind.EXCEPTION,
                                     detail="late report from the old process")]
            for msg in stale:
                with pytest.raises(FencedError, match=r"incarnation 1 is stale \(current 2"):
                    raise_for(conn.request(msg, 5), msg.type)
            assert isinstance(conn.request(p.ProcessExited(node_id="1", pid=101, exit_code=1), 5), p.Ok)
        finally:
            conn.close()
        with pytest.raises(FencedError, match="stale"):
            c1.join(after=1, timeout=2)
        old_heart = cl.heartbeat(c1.identity)
        wait_for(lambda: "stale" in old_heart.fenced, 5, "the old incarnation's heartbeater to be fenced")
        node = cl.node("1")
        assert (node["incarnation"], node["state"], node["pid"]) == (2, "alive", 102), node  # nothing stale applied

        # a stale generation: agreement and rendezvous store of generation 1 are refused once 2 formed
        assert [f.generation for f in join_all((c0, 1), (c1b, 0))] == [2, 2]
        with pytest.raises(FencedError, match=r"generation 1 is over \(now 2\)"):
            c0.agree(1, "restore", {"step": None, "disk": []}, timeout=2)
        with pytest.raises(FencedError, match=r"generation 1 refused \(now 2\)"):
            c0.store(p.StoreOp(generation=1, op="set", keys=["k"], value=b"old"))
        assert isinstance(c0.store(p.StoreOp(generation=2, op="set", keys=["k"], value=b"new")), p.StoreReply)

        # the job itself is unharmed: both finish and the scheduler ends it as done. A beat after the goodbye is
        # refused ("finished"): no error from a worker that is leaving (one logged on 2 of 20 clean runs of a blind port)
        hb0.leaving.set()
        c0.finish(True)
        wait_for(lambda: "finished" in hb0.fenced, 5, "a beat after node 0's goodbye to be refused")
        assert not [r for r in caplog.records if "refused heartbeat" in r.getMessage() and "'0'" in r.getMessage()]
        c1b.finish(True)
        assert cl.proc.wait(15) == 0
        kinds = [(e["node"], e["kind"]) for e in cl.events() if e["event"] == "failure_detected"]
        assert kinds == [("1", "connection")], kinds
    finally:
        cl.close()


# --- 6. quarantine ------------------------------------------------------------------------------


def test_flapping_node_is_quarantined_then_admitted_again(tmp_path):
    cl = LiveScheduler(tmp_path, TG_FLAP_LIMIT="2", TG_QUARANTINE="1.5")
    try:
        c0, _ = cl.worker("0", 100)
        for incarnation in (1, 2, 3):  # the third admission is the second re-admission: quarantine starts
            c, hb = cl.worker("1", 200 + incarnation)
            assert c.identity.incarnation == incarnation
            cl.die(hb, "1")

        with pytest.raises(RegistrationRejected) as info:
            cl.client(connect_timeout=0.3).register(node_id="1", host=ELSEWHERE, pid=300, worker_num=2)
        err = info.value
        assert err.code == "quarantined" and err.retry
        msg = str(err)
        assert "node id '1' is quarantined for another" in msg and "TG_FLAP_LIMIT=2" in msg, msg
        assert "TG_QUARANTINE=1.5" in msg and "admitted again" in msg, msg
        left = float(re.search(r"for another ([0-9.]+) s", msg).group(1))
        assert 0 < left <= 1.5
        rejected = [e for e in cl.events() if e["event"] == "register_rejected"]
        assert rejected and rejected[0]["code"] == "quarantined" and rejected[0]["node"] == "1"
        assert cl.node("1")["state"] == "dead"  # a refusal changes nothing

        # a patient worker (the runtime's retry) is admitted once the quarantine is over
        t0 = time.monotonic()
        c4, _ = cl.worker("1", 301)
        assert c4.identity.incarnation == 4 and c4.identity.node_id == "1"
        assert time.monotonic() - t0 < 5
        assert cl.node("1")["state"] == "alive"

        c0.finish(True)
        c4.finish(True)
        assert cl.proc.wait(15) == 0
    finally:
        cl.close()
