"""Three hosts on a real network (tests/netns.py: network namespaces, a bridge, veth links): the scheduler
and an agent on A, agents on B and C, one worker each, gloo over eth0. Every case ends bit-identical to
an undisturbed run of the same job on one host.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import sys
import time

import pytest
from harness import assert_identical, deaths, env, events, finals, job_args, wait_for, wait_step
from netns import Hosts

WHY = Hosts.unavailable()
pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(bool(WHY), reason=WHY)]
PORT = 29400  # each test has its own namespaces, so a fixed port cannot collide


@pytest.fixture
def hosts():
    h = Hosts().up()
    try:
        yield h
    finally:
        h.down()


@pytest.fixture
def baseline(baseline_runs):
    return baseline_runs(3)


def start(hosts: Hosts, out, *, faults: str = "", job_extra: tuple = (), flags: dict | None = None,
          **extra_env: str) -> dict:
    """An agent per host; `flags`: host -> its extra `trainguard run` flags."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "shared.secret").write_text("the secret the three hosts share\n")
    (out / "shared.secret").chmod(0o600)
    procs = {}
    for rank, host in enumerate(hosts.names):
        cmd = [sys.executable, "-m", "trainguard", "run", "--nnodes", "3", "--node-rank", str(rank), "--workers", "1",
               "--sched-host", hosts.addr["a"], "--sched-port", str(PORT), "--max-restarts", "3", "--hot-spares", "0",
               "--recovery-path", str(out / "recovery"), *(flags or {}).get(host, ()),
               *job_args(out, extra=job_extra)]
        secret = str(out / "shared.secret")
        procs[host] = hosts.popen(host, cmd, env(TG_FAULT=faults, TG_JOB_SECRET_FILE=secret, **extra_env),
                                  out / f"agent-{host}.log")
    return procs


def finish(procs: dict, out, timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    codes = {}
    for host, proc in procs.items():
        try:
            codes[host] = proc.wait(max(1.0, deadline - time.monotonic()))
        except Exception:
            codes[host] = None
    logs = {h: (out / f"agent-{h}.log").read_text()[-3000:] for h in procs}
    assert all(code == 0 for code in codes.values()), f"exit codes {codes}\n" + "\n".join(
        f"--- {h} ---\n{log}" for h, log in logs.items())


def check(out, expected) -> None:
    got = finals(out, 3)
    for rank in range(3):
        assert_identical(got[rank], expected[rank], f"rank {rank}")


def test_partitioned_host_is_fenced_and_its_stale_worker_never_counts(tmp_path, hosts, baseline):
    """C is cut off for longer than the heartbeat timeout (5 s here): its worker is fenced and A and B
    regroup. When the link comes back, C's stale incarnation is refused, the worker registers anew, takes
    the state of the generation A and B agreed on, and the job ends as if nothing had happened."""
    procs = start(hosts, tmp_path, job_extra=("--step-sleep", "0.15"))
    wait_for(lambda: any(e["event"] == "restore_step" for e in events(tmp_path)), 90, "training to start")
    wait_step(tmp_path, 3)  # a few steps in
    hosts.partition("c")
    wait_for(lambda: any(e["event"] == "failure_detected" and e["node"] == "2" for e in events(tmp_path)), 60,
             "C's worker to be declared dead")  # cut off for longer than the heartbeat timeout
    hosts.heal("c")
    finish(procs, tmp_path)
    check(tmp_path, baseline)
    ev = events(tmp_path)
    fenced = [e for e in ev if e["event"] == "failure_detected" and e["node"] == "2"]
    assert fenced and fenced[0]["kind"] == "heartbeat", fenced
    assert any(e["event"] == "registered" and e["node"] == "2" and e["incarnation"] >= 2 for e in ev)


def test_kill_9_on_host_b_over_slow_lossy_links_and_recover_moves_it_to_c(tmp_path, baseline):
    """50 ms on every packet each host sends and 1% of them lost (tc netem, or tests/tapswitch.py where the
    kernel has no netem). Under `recover`, with a free slot on C only, the worker on B is killed with kill -9
    after step 6: B's agent asks where it goes, the scheduler places it on C, C's agent starts it with the
    same node id, and it takes the agreed state over those links."""
    hosts = Hosts(delay_ms=50, loss=0.01).up()
    recover = ("--recover-strategy", "recover")
    try:
        assert 0.09 < hosts.connect_time("b", "a") < 0.5  # 50 ms each way: the links are slow for real
        # the kill is seen by B's agent at once; the heartbeat timeout only has to outlast the lossy links (TCP
        # retransmits a lost packet after 200 ms or more, and the user-space switch lags on a busy machine)
        procs = start(hosts, tmp_path, faults="1:6:kill", flags={"a": recover, "b": recover,
                                                                  "c": (*recover, "--slots", "2")},
                      TG_HEARTBEAT_TIMEOUT="8")
        finish(procs, tmp_path, timeout=200)
    finally:
        hosts.down()
    check(tmp_path, baseline)
    ev = events(tmp_path)
    assert [node for node, _ in deaths(ev)] == ["1"], ev
    assert [(e["node"], e["origin"], e["action"], e["target"]) for e in ev if e["event"] == "placement"] == [
        ("1", 1, "move", 2)]
    assert {(e["node"], e["incarnation"], e["host"]) for e in ev if e["event"] == "registered"} == {
        ("0", 1, "host-a"), ("1", 1, "host-b"), ("1", 2, "host-c"), ("2", 1, "host-c")}  # moved from B to C
