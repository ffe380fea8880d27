"""The `recover` strategy: a dead worker starts again on another host's agent with a free slot.

Pure decisions first (placement.py), then the scheduler's AgentBoard over the wire with made-up agents
(no torch), then two real agents on this machine standing for two hosts, with real workers and kill -9.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import assert_identical, env, events, finals, free_port, job_args

from trainguard.config import ClusterConfig, LaunchMode, Role
from trainguard.control import protocol as p
from trainguard.control.client import Connection
from trainguard.control.placement import (
    HostView,
    Place,
    PlacementPolicy,
    became_excluded,
    choose_host,
    excluded_until,
)
from trainguard.control.sched_main import start_in_thread
from trainguard.errors import ConfigError
from trainguard.launch import cli
from trainguard.launch.agent import Supervisor
from trainguard.launch.policy import LaunchSpec, scheduler_env, worker_env
from trainguard.launch.relocate import Relocation
from trainguard.strategies import parse_strategy, require_implemented

POLICY = PlacementPolicy(fail_limit=2, fail_window_s=60.0, cooldown_s=30.0)
NOW = 1000.0


def host(agent: int, slots: int, used: int, failures=(), seen: float = NOW) -> HostView:
    return HostView(agent, f"h{agent}", slots, used, tuple(failures), seen)


# --- pure decisions -------------------------------------------------------------------------------


@pytest.mark.timeout(5)
def test_moves_to_another_host_with_a_free_slot() -> None:
    d = choose_host([host(0, 1, 0, [NOW]), host(1, 2, 1), host(2, 1, 1)], 0, NOW, POLICY, in_place_ok=True)
    assert d.action is Place.MOVE and d.target == 1 and "1 of 2 slots free" in d.reason
    # the most free slots wins; then the fewest recent failures; then the lowest node rank
    hosts = [host(0, 1, 0), host(1, 2, 1), host(2, 3, 1), host(3, 3, 1, [NOW - 5])]
    assert choose_host(hosts, 0, NOW, POLICY, in_place_ok=False).target == 2
    assert choose_host([host(0, 1, 0), host(2, 2, 1), host(1, 2, 1)], 0, NOW, POLICY, in_place_ok=False).target == 1


@pytest.mark.timeout(5)
def test_no_free_slot_falls_back_in_place_only_if_allowed() -> None:
    hosts = [host(0, 1, 0, [NOW]), host(1, 1, 1)]
    d = choose_host(hosts, 0, NOW, POLICY, in_place_ok=True)
    assert d.action is Place.IN_PLACE and d.target == 0 and "all 1 slots are used" in d.reason
    d = choose_host(hosts, 0, NOW, POLICY, in_place_ok=False)
    assert d.action is Place.FAIL and d.target is None
    assert "no host can take it" in d.reason and "recover-in-place is not chosen" in d.reason
    alone = choose_host([host(0, 4, 0)], 0, NOW, POLICY, in_place_ok=False)
    assert alone.action is Place.FAIL and "no other host" in alone.reason
    silent = choose_host([host(0, 1, 0), host(1, 2, 0, seen=NOW - 60)], 0, NOW, POLICY, in_place_ok=False)
    assert silent.action is Place.FAIL and "silent" in silent.reason


@pytest.mark.timeout(5)
def test_exclusion_window_and_cooldown() -> None:
    assert excluded_until([NOW - 70, NOW], NOW, POLICY) == 0.0  # 2 failures, but not within 60 s
    assert excluded_until([NOW - 10, NOW], NOW, POLICY) == NOW + 30  # the 2nd within 60 s: 30 s from the last
    assert excluded_until([NOW - 10, NOW], NOW + 29.9, POLICY) == NOW + 30
    assert excluded_until([NOW - 10, NOW], NOW + 30, POLICY) == 0.0  # the cooldown is over
    assert excluded_until([NOW], NOW, POLICY) == 0.0
    assert became_excluded([NOW - 10], [NOW - 10, NOW], NOW, POLICY) == NOW + 30
    assert became_excluded([NOW - 10, NOW], [NOW - 10, NOW, NOW], NOW, POLICY) == 0.0  # already excluded
    one = PlacementPolicy(fail_limit=1, fail_window_s=1.0, cooldown_s=5.0)
    assert excluded_until([NOW], NOW + 4, one) == NOW + 5


@pytest.mark.timeout(5)
def test_excluded_hosts_take_no_worker_and_no_in_place_restart() -> None:
    excluded = [NOW - 5, NOW - 1]
    d = choose_host([host(0, 1, 0, [NOW]), host(1, 3, 0, excluded), host(2, 2, 1)], 0, NOW, POLICY,
                    in_place_ok=True)
    assert d.action is Place.MOVE and d.target == 2  # host 1 has more room, but it is excluded
    d = choose_host([host(0, 1, 0, [NOW]), host(1, 3, 0, excluded)], 0, NOW, POLICY, in_place_ok=True)
    assert d.action is Place.IN_PLACE
    d = choose_host([host(0, 1, 0, [NOW - 1, NOW]), host(1, 3, 0, excluded)], 0, NOW, POLICY, in_place_ok=True)
    assert d.action is Place.FAIL and "node rank 1 (h1) is excluded for another 29 s" in d.reason
    assert "its own host node rank 0 (h0) is excluded" in d.reason
    d = choose_host([host(0, 1, 0, [NOW]), host(1, 3, 0, excluded, seen=NOW + 30)], 0, NOW + 30, POLICY,
                    in_place_ok=False)
    assert d.action is Place.MOVE and d.target == 1  # after the cooldown it takes workers again


@pytest.mark.timeout(5)
def test_configuration() -> None:
    assert require_implemented(parse_strategy("recover")).moves
    assert require_implemented(parse_strategy("recover,recover-in-place,dump")).moves
    assert not parse_strategy("recover-in-place").moves
    with pytest.raises(ConfigError, match="--host-fail-limit"):
        PlacementPolicy(fail_limit=0)
    with pytest.raises(ConfigError, match="TG_HOST_COOLDOWN"):
        PlacementPolicy.from_env({"TG_HOST_COOLDOWN": "soon"})
    assert PlacementPolicy.from_env({"TG_HOST_FAIL_LIMIT": "4", "TG_HOST_COOLDOWN": "9"}).env() == {
        "TG_HOST_FAIL_LIMIT": "4", "TG_HOST_FAIL_WINDOW": "300", "TG_HOST_COOLDOWN": "9"}
    with pytest.raises(ConfigError, match="--slots must be >= the workers on this host"):
        LaunchSpec(script="x.py", sched_port=9, nproc_per_node=2, slots=1)
    spec = LaunchSpec(script="x.py", sched_port=9, nproc_per_node=1, nnodes=2, node_rank=1, slots=2,
                      placement=PlacementPolicy(cooldown_s=7))
    assert spec.capacity == 2 and LaunchSpec(script="x.py", sched_port=9, nproc_per_node=3).capacity == 3
    assert worker_env({}, spec, 0)["TG_NODE_ID"] == "1"
    moved = worker_env({}, spec, 1, node_id="0")  # placed here from node rank 0: same node id, same rank
    assert moved["TG_NODE_ID"] == "0" and moved["TG_LOCAL_RANK"] == "1"
    assert scheduler_env({}, spec)["TG_HOST_COOLDOWN"] == "7"


@pytest.mark.timeout(5)
def test_flags_and_job_file(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    job = tmp_path / "job.yaml"
    job.write_text(f"script: {script}\nslots: 3\nhost_fail_limit: 2\nhost_cooldown: 45\n")
    argv = ["run", "--nnodes", "2", "--node-rank", "1", "--sched-host", "127.0.0.1", "--sched-port", "9",
            "--max-restarts", "0", "--recover-strategy", "recover", "--config", str(job)]
    secret = {"TG_JOB_SECRET": "a shared secret of this test"}  # several hosts: a secret must be given
    spec = cli.resolve_run(cli.build_parser().parse_args([*argv, "--host-cooldown", "20"]),
                           {"TG_HOST_FAIL_WINDOW": "99", **secret})
    assert spec.capacity == 3 and spec.recover_strategy.moves
    assert spec.placement == PlacementPolicy(fail_limit=2, fail_window_s=99, cooldown_s=20)  # flag > file > env
    with pytest.raises(ConfigError, match="--slots"):
        cli.resolve_run(cli.build_parser().parse_args([*argv, "--workers", "4"]), secret)
    with pytest.raises(ConfigError, match="needs the same secret on every agent"):
        cli.resolve_run(cli.build_parser().parse_args(argv), {})
    assert cli.resolve_run(cli.build_parser().parse_args(argv), {"TG_INSECURE": "1"}).secret is None


@pytest.mark.timeout(5)
def test_a_placed_worker_keeps_its_node_id_and_takes_a_free_local_rank(tmp_path) -> None:
    spec = LaunchSpec(script="x.py", sched_port=9, nproc_per_node=2, nnodes=2, node_rank=1, slots=3, max_restarts=1,
                      recovery_path=tmp_path, recover_strategy=parse_strategy("recover"))
    sup = Supervisor(spec, env={})
    assert [w.node_id for w in sup.workers] == ["2", "3"]
    sup.workers[0].done = True  # worker 2 moved to another host
    relocation = Relocation(sup, spec, say=lambda _line: None)  # what the Supervisor holds under recover
    placed = relocation.placed_worker("0")
    assert (placed.node_id, placed.index, placed.env["TG_NODE_ID"], placed.env["TG_LOCAL_RANK"]) == ("0", 0, "0", "0")
    back = relocation.placed_worker("2")  # worker 2 comes back: its own child again, with a local rank now free
    assert back is sup.workers[0] and back.index == 2 and back.env["TG_LOCAL_RANK"] == "2"
    assert len(sup.workers) == 3


# --- the scheduler's board over the wire (made-up agents, no torch) --------------------------------------


def sync(conn: Connection, agent: int, slots: int, running: list[str], handled=()) -> p.AgentOrders:
    reply = conn.request(p.AgentSync(agent=agent, host=f"h{agent}", slots=slots, running=running,
                                     handled=list(handled)), 5)
    assert isinstance(reply, p.AgentOrders), reply
    return reply


def place(conn: Connection, agent: int, node: str, in_place_ok: bool = False) -> p.Placed:
    reply = conn.request(p.AgentPlace(agent=agent, node_id=node, in_place_ok=in_place_ok), 5)
    assert isinstance(reply, p.Placed), reply
    return reply


@pytest.mark.timeout(20)
def test_scheduler_places_and_excludes_a_failing_host_for_the_cooldown(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TG_HOST_FAIL_LIMIT", "2")
    monkeypatch.setenv("TG_HOST_COOLDOWN", "1.5")
    cfg = ClusterConfig(role=Role.SCHEDULER, mode=LaunchMode.DYNAMIC, sched_host="127.0.0.1", sched_port=0,
                        worker_num=2, enable_recovery=True, recovery_path=tmp_path / "recovery",
                        heartbeat_interval=0.5, heartbeat_timeout=30.0)
    sched, _ = start_in_thread(cfg)
    a = Connection(("127.0.0.1", sched.port), 5)
    b = Connection(("127.0.0.1", sched.port), 5)
    try:
        assert sync(a, 0, 2, ["0"]).start == [] and sync(b, 1, 2, ["1"]).job == "running"
        moved = place(a, 0, "0")  # A's 1st failure
        assert (moved.action, moved.target) == ("move", 1)
        order = sync(b, 1, 2, ["1"]).start
        assert [(o.node_id, o.origin) for o in order] == [("0", 0)]
        assert sync(b, 1, 2, ["1"]).start == order  # delivered again until B says it handled it
        assert sync(b, 1, 2, ["1", "0"], [order[0].seq]).start == []
        full = place(b, 1, "1", in_place_ok=True)  # B's 1st failure: A has 2 free slots
        assert (full.action, full.target) == ("move", 0)
        seq = sync(a, 0, 2, []).start[0].seq
        sync(a, 0, 2, ["1"], [seq])
        back = place(a, 0, "1")  # A's 2nd failure within the window: A is excluded; B has room
        assert (back.action, back.target) == ("move", 1)
        seq = sync(b, 1, 2, ["0"]).start[0].seq
        sync(b, 1, 2, ["0", "1"], [seq])
        refused = place(b, 1, "0")  # B: its 2nd failure; A has room but is excluded
        assert refused.action == "fail" and "node rank 0 (h0) is excluded for another" in refused.reason
        sync(a, 0, 2, [])
        time.sleep(1.6)  # both cooldowns end
        sync(a, 0, 2, [])
        again = place(b, 1, "1")  # B's 3rd failure excludes it again, but A takes workers again
        assert (again.action, again.target) == ("move", 0), again.reason
    finally:
        a.close()
        b.close()
    excluded = [e for e in events(tmp_path) if e["event"] == "host_excluded"]
    assert [e["agent"] for e in excluded] == [0, 1, 1] and excluded[0]["cooldown"] == 1.5
    placements = [(e["origin"], e["action"], e["target"]) for e in events(tmp_path) if e["event"] == "placement"]
    assert placements == [(0, "move", 1), (1, "move", 0), (0, "move", 1), (1, "fail", None), (1, "move", 0)]


# --- two agents on this machine, standing for two hosts -----------------------------------------------------


def agent(out: Path, rank: int, port: int, *, slots: int, strategy: str, faults: str, spares: int = 0,
          extra: tuple = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trainguard", "run", "--nnodes", "2", "--node-rank", str(rank), "--workers", "1",
           "--slots", str(slots), "--sched-host", "127.0.0.1", "--sched-port", str(port), "--max-restarts", "3",
           "--hot-spares", str(spares), "--recovery-path", str(out / "recovery"), "--recover-strategy", strategy,
           *extra, *job_args(out)]
    return subprocess.Popen(cmd, env=env(TG_FAULT=faults, TG_JOB_SECRET_FILE=str(out / "shared.secret")),
                            stdout=open(out / f"agent{rank}.out", "w"),
                            stderr=open(out / f"agent{rank}.err", "w"))


def run_two_agents(out: Path, *, b_slots: int, strategy: str, faults: str, extra: tuple = (),
                   timeout: float = 120) -> tuple[int, int, str, str]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "shared.secret").write_text("the secret both agents share\n")
    port = free_port()
    procs = [agent(out, 0, port, slots=1, strategy=strategy, faults=faults, extra=extra),
             agent(out, 1, port, slots=b_slots, strategy=strategy, faults=faults, spares=1, extra=extra)]
    try:
        codes = [proc.wait(timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    logs = [(out / f"agent{r}.out").read_text() + (out / f"agent{r}.err").read_text() for r in (0, 1)]
    return codes[0], codes[1], logs[0], logs[1]


@pytest.fixture(scope="module")
def baseline(baseline_runs):
    return baseline_runs(2)


@pytest.mark.timeout(150)
def test_killed_worker_moves_to_the_other_agent_bit_identical(tmp_path, baseline) -> None:
    a, b, log_a, log_b = run_two_agents(tmp_path, b_slots=2, strategy="recover", faults="0:5:kill")
    assert (a, b) == (0, 0), f"agent 0:\n{log_a[-3000:]}\nagent 1:\n{log_b[-3000:]}"
    moves = [e for e in events(tmp_path) if e["event"] == "placement"]
    assert [(e["node"], e["origin"], e["action"], e["target"]) for e in moves] == [("0", 0, "move", 1)]
    assert "worker 0 goes to the agent of node rank 1" in log_a
    assert "placed here by the scheduler: it died on node rank 0" in log_b  # agent B started it ...
    assert "[worker 0] rank 0: done after" in log_b  # ... and it finished there
    assert "rank 0: done after" not in log_a
    for rank, (got, want) in enumerate(zip(finals(tmp_path, 2), baseline)):
        assert_identical(got, want, f"rank {rank}")


@pytest.mark.timeout(150)
def test_no_free_slot_elsewhere_restarts_in_place_when_allowed(tmp_path, baseline) -> None:
    a, b, log_a, log_b = run_two_agents(tmp_path, b_slots=1, strategy="recover,recover-in-place", faults="0:5:kill")
    assert (a, b) == (0, 0), f"agent 0:\n{log_a[-3000:]}\nagent 1:\n{log_b[-3000:]}"
    moves = [(e["node"], e["action"], e["target"]) for e in events(tmp_path) if e["event"] == "placement"]
    assert moves == [("0", "in_place", 0)]
    assert "node rank 1 (" in log_a and "all 1 slots are used" in log_a and "[worker 0] rank 0: done after" in log_a
    for rank, (got, want) in enumerate(zip(finals(tmp_path, 2), baseline)):
        assert_identical(got, want, f"rank {rank}")


@pytest.mark.timeout(150)
def test_a_host_that_keeps_failing_is_excluded(tmp_path) -> None:
    """Limit 1: agent A's first failure excludes it. Its worker moves to B; when B's own worker dies
    next, A has a free slot but is in its cooldown, so the job fails, naming why."""
    a, b, log_a, log_b = run_two_agents(tmp_path, b_slots=2, strategy="recover", faults="0:3:kill,1:8:kill",
                                        extra=("--host-fail-limit", "1", "--host-cooldown", "600"))
    assert a != 0 and b != 0
    evs = events(tmp_path)
    assert [e["agent"] for e in evs if e["event"] == "host_excluded"] == [0, 1]
    placements = [(e["node"], e["action"], e["target"]) for e in evs if e["event"] == "placement"]
    assert placements == [("0", "move", 1), ("1", "fail", None)]
    assert "no host can take it: node rank 0" in log_b and "is excluded for another" in log_b
    end = [e for e in evs if e["event"] == "job_end"]
    assert end and end[-1]["state"] == "failed" and "excluded" in end[-1]["root_cause"]
