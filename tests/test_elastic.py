"""The elastic recover strategy: pure decisions (membership, re-sharding the rest of an epoch) and
one real job that shrinks from 2 workers to 1 and grows back to 2."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import assert_identical, env, events, finals, launch

from trainguard.config import from_env
from trainguard.control import formation as fm
from trainguard.control import membership as m
from trainguard.control.elastic import ElasticScheduling
from trainguard.control.protocol import FailureKind
from trainguard.errors import ConfigError
from trainguard.launch.policy import LaunchSpec, worker_env
from trainguard.strategies import parse_strategy, require_implemented
from trainguard.train.data.sampler import ShardedSampler
from trainguard.train.data.phase import Phase

pytestmark = pytest.mark.timeout(30)
JOB = Path(__file__).resolve().parent / "jobs" / "elastic_job.py"


# --- re-sharding the rest of an epoch ------------------------------------------------------


def _take(samplers, steps, batch):
    """`steps` batches from every shard, as DataLoaders in lockstep would draw them."""
    got = []
    for s in samplers:
        it = iter(s)
        got += [i for _, i in zip(range(steps * batch), it)]
    return got


def _shards(n, world, **kw):
    return [ShardedSampler(n, num_shards=world, shard_id=k, **kw) for k in range(world)]


@pytest.mark.parametrize("worlds", [(2, 1, 2), (3, 2), (4, 3, 1), (1, 4)])
def test_every_index_once_across_world_changes(worlds):
    n, batch = 240, 4
    seen = []
    samplers = _shards(n, worlds[0], seed=5)
    for world in worlds[1:]:
        seen += _take(samplers, 5, batch)  # 5 steps, then the world changes
        base = samplers[0].consumed(5 * batch)
        assert base == len(seen)
        samplers = _shards(n, world, seed=5)
        for k, s in enumerate(samplers):
            s.set_phase(base, world, k)
    seen += _take(samplers, 10**6, batch)  # the rest of the epoch
    assert sorted(seen) == list(range(n))


def test_the_rest_is_the_unconsumed_suffix_of_the_global_order():
    a, b = _shards(100, 2, seed=1)
    order = a.global_order()
    first = _take([a, b], 3, 5)  # 3 steps of 5 per shard: the first 30 of the global order
    assert sorted(first) == sorted(order[:30]) and a.consumed(15) == 30
    alone = ShardedSampler(100, num_shards=1, shard_id=0, seed=1)
    assert alone.reshard_rest(1, 0, position=0) == 0  # nothing consumed yet in its own phase
    alone.set_phase(30, 1, 0)
    assert list(alone) == order[30:] and len(alone) == 70


def test_phase_padding_and_drop_last():
    s = ShardedSampler(10, num_shards=1, shard_id=0, shuffle=False)
    s.set_phase(7, 2, 1)  # 3 left over 2 shards: padded by one index from the start of the order
    assert s.phase_order() == [7, 8, 9, 0] and list(s) == [8, 0] and len(s) == 2
    d = ShardedSampler(10, num_shards=2, shard_id=0, shuffle=False, drop_last=True)
    d.set_phase(7, 2, 0)  # with drop_last the odd one out is dropped
    assert list(d) == [7] and d.consumed(1) == 9
    assert d.consumed(99) == 9  # a position past the end counts the phase once


def test_phase_is_kept_in_the_state_dict_and_reset_by_a_new_epoch():
    s = ShardedSampler(50, num_shards=2, shard_id=1, seed=2)
    s.set_phase(20, 3, 1)
    s.set_position(4)
    t = ShardedSampler(50, num_shards=3, shard_id=1, seed=2)
    t.load_state_dict(s.state_dict())
    assert t.base == 20 and list(t) == list(s)
    t.set_epoch(1)
    assert t.base == 0 and len(t) == 17
    assert "base" not in ShardedSampler(8, num_shards=1, shard_id=0).state_dict()  # unchanged without phases
    with pytest.raises(ConfigError, match="base"):
        s.set_phase(51, 2, 0)


def test_worker_phase_progress_round_trip():
    assert Phase.of({"step": 3}, 2) == Phase(0, 0, 2)  # progress written without elastic
    p = Phase(64, 4, 1)
    assert Phase.of({"step": 9, **p.as_dict(2)}, 2) == p


# --- restore decisions ---------------------------------------------------------------------------


# --- membership decisions ---------------------------------------------------------------------


def _cluster(n=3) -> m.Cluster:
    c = m.Cluster(worker_num=n)
    for i in range(n):
        d = m.decide_register(c, str(i), n, 0.0, recovery=True, flap_limit=5, quarantine_s=30)
        m.apply_register(c, d, "h", 100 + i, 0.0, flap_limit=5, quarantine_s=30)
        c.joined.add(str(i))
    assert fm.try_form(c, 0.0, 2.0) and c.members == tuple(str(i) for i in range(n))
    return c


def _kill(c: m.Cluster, node_id: str, now: float) -> None:
    d = m.decide_failure(c, node_id, None, FailureKind.EXITED, "killed", recovery=True)
    m.apply_failure(c, node_id, d, now)


def test_shrink_waits_for_the_deadline_then_renumbers_in_node_order():
    c = _cluster()
    _kill(c, "1", now=10.0)
    c.joined.update({"0", "2"})
    f = fm.decide_formation(c, 11.0, 2.0)
    assert f.members is None and f.wake_at == 12.0 and "1" in f.reason
    assert not fm.try_form(c, 11.9, 2.0)
    assert not fm.try_form(c, 20.0, None)  # without elastic: never without all N
    assert fm.try_form(c, 12.0, 2.0)
    assert c.members == ("0", "2") and fm.generation_size(c) == 2
    assert [fm.generation_rank(c, x) for x in ("0", "2")] == [0, 1]
    assert c.nodes["2"].rank == 2  # the fixed rank is kept for growing back


def test_shrink_needs_every_live_member_joined_and_a_first_full_formation():
    c = _cluster()
    _kill(c, "2", now=0.0)
    c.joined.add("0")
    assert "waiting for 1" in fm.decide_formation(c, 100.0, 1.0).reason
    fresh = m.Cluster(worker_num=2)
    d = m.decide_register(fresh, "0", 2, 0.0, recovery=True, flap_limit=5, quarantine_s=30)
    m.apply_register(fresh, d, "h", 1, 0.0, flap_limit=5, quarantine_s=30)
    fresh.joined.add("0")
    assert "never formed" in fm.decide_formation(fresh, 100.0, 1.0).reason
    c2 = _cluster(2)
    _kill(c2, "1", 0.0)
    c2.nodes["0"].state = m.NodeState.UNKNOWN  # a restarted scheduler: the survivor has not reattached
    assert fm.decide_formation(c2, 100.0, 1.0).members is None


def test_a_returning_node_ends_the_smaller_generation_and_regains_its_rank():
    c = _cluster()
    _kill(c, "1", 0.0)
    c.joined.update({"0", "2"})
    assert fm.try_form(c, 5.0, 1.0)
    gen = c.generation
    d = m.decide_register(c, "1", 3, 6.0, recovery=True, flap_limit=5, quarantine_s=30)
    assert d.action is m.Action.READMIT and d.rank == 1
    m.apply_register(c, d, "h", 999, 6.0, flap_limit=5, quarantine_s=30)
    assert fm.decide_regrow(c, "1") and not fm.decide_regrow(c, "0")
    assert ElasticScheduling(1.0, c, 6.0).regrow(c, "1")
    assert c.generation == gen + 1 and not c.formed
    c.joined.update({"0", "1", "2"})
    assert fm.try_form(c, 6.1, 1.0) and c.members == ("0", "1", "2")
    assert fm.generation_rank(c, "2") == 2


def test_elastic_job_ends_without_waiting_for_the_dead():
    c = _cluster(2)
    _kill(c, "1", 0.0)
    m.apply_finish(c, "0")
    assert c.job is m.JobState.RUNNING  # the normal rule waits for all N
    assert fm.elastic_job_over(c) is m.JobState.DONE
    assert ElasticScheduling(1.0, c, 0.0).job_over(c) and c.job is m.JobState.DONE


def test_after_the_finish_agreement_latecomers_are_refused_and_only_its_members_are_waited_for():
    c = _cluster(2)
    _kill(c, "1", 0.0)
    c.joined.add("0")
    assert fm.try_form(c, 5.0, 1.0) and c.members == ("0",)
    sched = ElasticScheduling(1.0, c, 5.0)
    sched.finishing(c)
    assert c.finishing == ("0",)
    d = m.decide_register(c, "1", 2, 6.0, recovery=True, flap_limit=5, quarantine_s=30)
    assert d.action is m.Action.REJECT and d.code.value == "job_over" and "too late" in d.reason
    m.apply_finish(c, "0")
    assert sched.job_over(c) and c.job is m.JobState.DONE


def test_the_launcher_leaves_a_worker_out_when_its_restarts_are_used_up():
    from trainguard.config import Role
    from trainguard.launch.policy import Action, decide_exit

    elastic = parse_strategy("elastic")
    assert decide_exit(Role.WORKER, -9, 0, 2, elastic).action is Action.RESTART
    left = decide_exit(Role.WORKER, -9, 2, 2, elastic)
    assert left.action is Action.LEFT_OUT and "goes on without it" in left.reason
    assert decide_exit(Role.WORKER, -9, 0, 0, elastic).action is Action.GIVE_UP  # recovery off
    assert decide_exit(Role.WORKER, -9, 2, 2).action is Action.GIVE_UP  # recover-in-place


def test_a_restarted_scheduler_restarts_the_deadline_clock():
    c = _cluster(2)
    c.nodes["1"].state = m.NodeState.DEAD  # as loaded from cluster.db: no death time
    c.members = ()  # nor a member list
    ElasticScheduling(3.0, c, now=50.0)
    assert c.nodes["1"].dead_since == 50.0 and c.members == ("0",)
    d = m.decide_register(c, "1", 2, 51.0, recovery=True, flap_limit=5, quarantine_s=30)
    m.apply_register(c, d, "h", 7, 51.0, flap_limit=5, quarantine_s=30)
    assert fm.decide_regrow(c, "1")  # its return still ends the smaller generation


def test_deadline_from_the_job_file_or_flag():
    import argparse

    from trainguard.launch.jobfile import resolve_strategy

    args = argparse.Namespace(recover_strategy="elastic", max_retries=None, grace_period=None, elastic_deadline=4.0)
    assert resolve_strategy(args, {"TG_ELASTIC_DEADLINE": "9"})[0].elastic_deadline == 4.0
    args.elastic_deadline = None
    assert resolve_strategy(args, {"TG_ELASTIC_DEADLINE": "9"})[0].elastic_deadline == 9.0


# --- configuration -------------------------------------------------------------------------------


def test_elastic_is_accepted_with_a_deadline_and_exit_contradicts_it():
    s = require_implemented(parse_strategy("elastic", elastic_deadline=1.5))
    assert s.elastic and s.restarts and s.rolls_back and s.elastic_deadline == 1.5
    with pytest.raises(ConfigError, match="contradicts itself"):
        parse_strategy("exit,elastic")
    with pytest.raises(ConfigError, match="elastic deadline"):
        parse_strategy("elastic", elastic_deadline=0)
    base = {"TG_ROLE": "worker", "TG_SCHED_HOST": "127.0.0.1", "TG_SCHED_PORT": "8118", "TG_WORKER_NUM": "2"}
    cfg = from_env({**base, "TG_RECOVER_STRATEGY": "elastic", "TG_ELASTIC_DEADLINE": "2.5"})
    assert cfg.recover_strategy.elastic and cfg.recover_strategy.elastic_deadline == 2.5
    with pytest.raises(ConfigError, match="TG_ELASTIC_DEADLINE"):
        from_env({**base, "TG_ELASTIC_DEADLINE": "-1"})
    spec = LaunchSpec(script="x.py", sched_port=9, recover_strategy=s)
    assert worker_env({}, spec, 0)["TG_ELASTIC_DEADLINE"] == "1.5"


# --- a real job: 2 -> 1 -> 2 ------------------------------------------------------------------------


def _kept_lines(out: Path) -> list[dict]:
    """Each step's lines from the newest generation that ran it (older runs of it were rolled back)."""
    lines = [json.loads(ln) for f in (out / "samples").glob("*.jsonl") for ln in f.read_text().splitlines() if ln]
    newest: dict[int, int] = {}
    for ln in lines:
        newest[ln["step"]] = max(newest.get(ln["step"], 0), ln["gen"])
    return [ln for ln in lines if ln["gen"] == newest[ln["step"]]]


@pytest.mark.timeout(150)
def test_shrink_to_one_and_grow_back(tmp_path):
    samples, epochs = 256, 6  # alone, the survivor needs ~20 s for the rest: time for a slow restart to come back
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", "2", "--recovery-path", str(tmp_path / "recovery"),
           "--recover-strategy", "elastic", "--elastic-deadline", "1", str(JOB), "--out", str(tmp_path),
           "--epochs", str(epochs), "--samples", str(samples), "--step-sleep", "0.1", "--return-delay", "3"]
    proc = subprocess.run(cmd, env=env(TG_FAULT="1:5:kill"), capture_output=True, text=True, timeout=120)
    (tmp_path / "launcher.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restarted; coming back in 3 s" in proc.stdout  # the replacement came back after the deadline
    for rank in (0, 1):
        assert f"rank {rank} (node {rank}): done" in proc.stdout and "world size 2" in proc.stdout

    # the world size went 2 -> 1 -> 2
    ev = events(tmp_path)
    worlds = [e["world_size"] for e in ev if e["event"] == "generation_formed"]
    assert worlds[:3] == [2, 1, 2] and worlds[-1] == 2, worlds
    assert any(e["event"] == "generation_bumped" and e.get("reason") == "elastic_regrow" for e in ev)
    resharded = [(e["from_world"], e["world_size"]) for e in ev if e["event"] == "data_resharded"]
    assert resharded[:2] == [(2, 1), (1, 2)], resharded

    # every sample exactly once per epoch, counted over the steps that stood
    kept = _assert_each_sample_once_per_epoch(tmp_path, samples, epochs)
    assert {ln["world"] for ln in kept} == {1, 2}

def _assert_each_sample_once_per_epoch(out: Path, samples: int, epochs: int) -> list[dict]:
    kept = _kept_lines(out)
    per_epoch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for ln in kept:
        per_epoch[ln["epoch"]].update(ln["idx"])
    assert sorted(per_epoch) == list(range(epochs))
    for epoch, counts in per_epoch.items():
        twice = sorted(i for i, c in counts.items() if c > 1)
        missing = sorted(set(range(samples)) - set(counts))
        assert not twice and not missing, f"epoch {epoch}: seen twice {twice[:10]}, never {missing[:10]}"
    return kept


@pytest.mark.timeout(150)
def test_a_worker_out_of_restarts_is_left_out_and_the_job_completes(tmp_path):
    samples, epochs = 192, 3
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", "2", "--recovery-path", str(tmp_path / "recovery"),
           "--recover-strategy", "elastic", "--elastic-deadline", "2", "--max-restarts", "1", str(JOB),
           "--out", str(tmp_path), "--epochs", str(epochs), "--samples", str(samples), "--step-sleep", "0.05",
           "--kill-restarted-after", "4"]
    proc = subprocess.run(cmd, env=env(TG_FAULT="1:3:kill"), capture_output=True, text=True, timeout=120)
    (tmp_path / "launcher.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "worker 1 is not restarted: all 1 restarts are used; elastic" in proc.stderr
    assert "rank 0 (node 0): done" in proc.stdout and "world size 1" in proc.stdout
    worlds = [e["world_size"] for e in events(tmp_path) if e["event"] == "generation_formed"]
    assert worlds[0] == 2 and worlds[-1] == 1, worlds
    _assert_each_sample_once_per_epoch(tmp_path, samples, epochs)


@pytest.mark.timeout(150)
def test_a_replacement_back_after_the_end_is_stopped_and_the_job_succeeds(tmp_path):
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", "2", "--recovery-path", str(tmp_path / "recovery"),
           "--recover-strategy", "elastic", "--elastic-deadline", "1", str(JOB), "--out", str(tmp_path),
           "--epochs", "1", "--samples", "64", "--return-delay", "60"]
    proc = subprocess.run(cmd, env=env(TG_FAULT="1:1:kill"), capture_output=True, text=True, timeout=120)
    (tmp_path / "launcher.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "worker 1 came back too late and is stopped" in proc.stderr
    assert "rank 0 (node 0): done" in proc.stdout
    _assert_each_sample_once_per_epoch(tmp_path, 64, 1)


# --- the DP test job under elastic ---------------------------------------------------------------


@pytest.mark.timeout(200)
def test_dp_job_worker_back_within_the_deadline_is_bit_identical(tmp_path, monkeypatch):
    """Back in time, elastic is recover-in-place: the final state equals an uninterrupted run's."""
    base, run = tmp_path / "base", tmp_path / "elastic"
    proc = launch(base, 2, max_restarts=0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    monkeypatch.setenv("TG_RECOVER_STRATEGY", "elastic")
    monkeypatch.setenv("TG_ELASTIC_DEADLINE", "60")
    proc = launch(run, 2, faults="1:5:kill")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {e["world_size"] for e in events(run) if e["event"] == "generation_formed"} == {2}
    for rank, (got, want) in enumerate(zip(finals(run, 2), finals(base, 2))):
        assert_identical(got, want, f"rank {rank}")


@pytest.mark.timeout(200)
def test_dp_job_high_level_shrinks_and_grows_back(tmp_path, monkeypatch):
    """A restart slower than the deadline: 2 -> 1 -> 2, replicas equal at the end."""
    monkeypatch.setenv("TG_RECOVER_STRATEGY", "elastic")
    monkeypatch.setenv("TG_ELASTIC_DEADLINE", "0.3")
    proc = launch(tmp_path, 2, faults="1:5:kill", level="high", epochs=5,
                  extra=("--step-sleep", "0.15", "--restart-delay", "3"), spares=0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    worlds = [e["world_size"] for e in events(tmp_path) if e["event"] == "generation_formed"]
    assert 1 in worlds and worlds[-1] == 2, worlds
    a, b = finals(tmp_path, 2)
    assert_identical(a["model"], b["model"], "model") and a["steps"] == b["steps"]
    assert_identical(a["optimizer"], b["optimizer"], "optimizer")
