"""Recover strategies, exit codes and the launcher's choices about them: pure functions, no processes."""

from __future__ import annotations

import signal

import pytest
import torch

from trainguard.config import Role, from_env
from trainguard.control import membership as m
from trainguard.control.protocol import FailureKind
from trainguard.errors import ConfigError
from trainguard.exitcodes import EXIT_FAULT_STOP, EXIT_PREEMPTED
from trainguard.launch import cli
from trainguard.launch.chaos import pick_target
from trainguard.launch.jobfile import load_job_file
from trainguard.launch.policy import (
    Action,
    Failure,
    LaunchSpec,
    decide_exit,
    ended_exit,
    failure_summary,
    signalled_exit,
    worker_env,
)
from trainguard.strategies import Strategy, parse_strategy, require_implemented
from trainguard.train.state import parallel_strategy
from trainguard.train.engine.dump import plan_dump, who_died
from trainguard.train.engine.graceful import StopRequest

pytestmark = pytest.mark.timeout(30)


# --- parsing ------------------------------------------------------------------------------


def test_default_is_recover_in_place():
    for text in (None, "", "  "):
        s = parse_strategy(text)
        assert s.chosen == {Strategy.RECOVER_IN_PLACE} and s.restarts and s.rolls_back and not s.retry
        assert str(s) == "recover-in-place"


def test_names_combine_with_commas_in_any_case_and_order():
    s = parse_strategy(" Dump , retry,RECOVER-IN-PLACE ", max_retries=5)
    assert s.chosen == {Strategy.DUMP, Strategy.RETRY, Strategy.RECOVER_IN_PLACE}
    assert str(s) == "retry,recover-in-place,dump" and s.max_retries == 5
    assert s.dump and s.retry and s.restarts


def test_alias_elastic_training():
    assert parse_strategy("elastic-training").chosen == {Strategy.ELASTIC}


def test_flags_of_each_single_strategy():
    retry = parse_strategy("retry")
    assert retry.retry and retry.rolls_back and not retry.restarts  # retried in process, a death stops the job
    for name in ("exit", "dump"):
        s = parse_strategy(name)
        assert not s.rolls_back and not s.restarts
    assert parse_strategy("dump,exit").dump  # dump already exits: not a contradiction


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        parse_strategy("retry,reboot", source="TG_RECOVER_STRATEGY")
    msg = str(info.value)
    assert "TG_RECOVER_STRATEGY='retry,reboot'" in msg and "'reboot'" in msg
    for name in ("retry", "recover", "recover-in-place", "elastic", "dump", "exit"):
        assert name in msg


def test_empty_name_between_commas():
    with pytest.raises(ConfigError, match="empty name"):
        parse_strategy("retry,,exit")


@pytest.mark.parametrize("other", ["recover-in-place", "recover", "elastic"])
def test_exit_contradicts_what_restarts(other):
    with pytest.raises(ConfigError) as info:
        parse_strategy(f"exit,{other}")
    assert "contradicts itself" in str(info.value) and "exit stops the whole job" in str(info.value)


def test_every_strategy_is_accepted_at_start():
    for text in ("recover", "retry,elastic", "elastic,recover-in-place"):  # all built now
        assert require_implemented(parse_strategy(text)).chosen
    assert require_implemented(parse_strategy("retry,elastic")).elastic
    assert require_implemented(parse_strategy("retry,dump")).dump


def test_negative_retry_limit():
    with pytest.raises(ConfigError, match="retry limit"):
        parse_strategy("retry", max_retries=-1)


# --- environment and launcher ---------------------------------------------------------


WORKER = {"TG_ROLE": "worker", "TG_SCHED_HOST": "127.0.0.1", "TG_SCHED_PORT": "8118", "TG_WORKER_NUM": "2"}


def test_worker_env_names():
    cfg = from_env({**WORKER, "TG_RECOVER_STRATEGY": "retry,exit", "TG_MAX_RETRIES": "7", "TG_GRACE_PERIOD": "2.5"})
    assert str(cfg.recover_strategy) == "retry,exit" and cfg.recover_strategy.max_retries == 7
    assert cfg.grace_period == 2.5
    for bad, name in (({"TG_RECOVER_STRATEGY": "bogus"}, "unknown recover strategy"), ({"TG_MAX_RETRIES": "x"},
                      "TG_MAX_RETRIES"), ({"TG_GRACE_PERIOD": "0"}, "TG_GRACE_PERIOD")):
        with pytest.raises(ConfigError, match=name):
            from_env({**WORKER, **bad})


def test_launcher_passes_one_grace_period_and_the_strategy_to_every_child():
    spec = LaunchSpec(script="x.py", sched_port=9, grace_s=3.0, recover_strategy=parse_strategy("retry,dump", max_retries=2))
    env = worker_env({}, spec, 0)
    assert (env["TG_GRACE_PERIOD"], env["TG_RECOVER_STRATEGY"], env["TG_MAX_RETRIES"]) == ("3", "retry,dump", "2")
    assert not spec.uses_hot_spares  # nobody is replaced, so no spare is kept warm


def test_decide_exit_follows_the_strategy():
    exit_ = parse_strategy("exit")
    assert decide_exit(Role.WORKER, -9, 0, 3, exit_).action is Action.GIVE_UP
    assert "recover strategy is exit" in decide_exit(Role.WORKER, 1, 0, 3, exit_).reason
    assert decide_exit(Role.WORKER, -9, 0, 3).action is Action.RESTART  # default: recover-in-place
    assert decide_exit(Role.SCHEDULER, -9, 0, 3, exit_).action is Action.RESTART  # it holds no training state
    assert decide_exit(Role.WORKER, EXIT_PREEMPTED, 0, 3).action is Action.PREEMPTED
    assert decide_exit(Role.WORKER, EXIT_FAULT_STOP, 0, 3).action is Action.STOPPED
    assert decide_exit(Role.WORKER, -9, 0, 3, stopping=True).action is Action.STOPPED
    assert decide_exit(Role.SCHEDULER, EXIT_PREEMPTED, 0, 3).action is Action.FINISHED


def test_agent_exit_codes():
    assert ended_exit(False, [], None, 0) == (0, "")
    code, msg = ended_exit(True, [], None, 0, saved=True)
    assert code == EXIT_PREEMPTED and "run the same command again to resume" in msg
    code, msg = ended_exit(True, [], None, 0, saved=False)
    assert code == EXIT_PREEMPTED and "starts over" in msg and "to resume" not in msg
    stop = Failure("worker 0", 10, EXIT_FAULT_STOP, ("stopping (recover strategy exit): step 5: gloo",))
    code, msg = ended_exit(False, [stop], None, 0)
    assert code == EXIT_FAULT_STOP and "step 5: gloo" in msg
    root = Failure("worker 1", 11, -9)
    assert ended_exit(False, [stop], root, 0) == (1, failure_summary(root, 0))
    code, msg = ended_exit(False, [stop], root, 1, done=True)  # killed after every rank's script ended: nothing to redo
    assert code == 0 and "the job finished" in msg and "worker 1 (pid 11) was killed by signal SIGKILL" in msg, msg
    assert signalled_exit([EXIT_PREEMPTED, 0], signal.SIGTERM)[0] == EXIT_PREEMPTED
    assert signalled_exit([EXIT_PREEMPTED, -9], signal.SIGTERM) == (128 + signal.SIGTERM, "")
    assert signalled_exit([0, 0], signal.SIGINT) == (128 + signal.SIGINT, "")


def test_max_restarts_message_names_the_count_the_root_cause_and_the_last_failure():
    root, last = Failure("worker 1", 100, -9), Failure("worker 1", 200, -9, ("boom",))
    text = failure_summary(root, 2, last, 2)
    assert text.splitlines()[0] == "trainguard: giving up after 2 restarts; root cause: worker 1 (pid 100) was killed by signal SIGKILL"
    assert "max restarts: 2 of 2 used" in text and "last failure: worker 1 (pid 200)" in text
    assert text.endswith("    boom")


# --- the scheduler's side (membership) ----------------------------------------------------


def _cluster() -> m.Cluster:
    c = m.Cluster(worker_num=2, formed=True)
    for i in range(2):
        c.nodes[str(i)] = m.Node(str(i), i, "h", 100 + i, 1, m.NodeState.ALIVE, 0.0)
    return c


def test_graceful_finish_ends_the_job_stopped():
    c = _cluster()
    m.apply_finish(c, "0", stopped=True, detail="stopped on SIGTERM at step 8")
    assert c.job is m.JobState.RUNNING and c.nodes["0"].state is m.NodeState.STOPPED
    m.apply_finish(c, "1", stopped=True)
    assert c.job is m.JobState.STOPPED and c.root_cause == "stopped on SIGTERM at step 8"
    c2 = _cluster()
    m.apply_finish(c2, "0")
    m.apply_finish(c2, "1")
    assert c2.job is m.JobState.DONE


def test_a_final_report_about_a_dead_worker_fails_the_job():
    c = _cluster()
    d = m.decide_failure(c, "1", 1, FailureKind.CONNECTION, "closed", recovery=True)
    m.apply_failure(c, "1", d)
    assert c.job is m.JobState.RUNNING  # a replacement is expected
    d = m.decide_failure(c, "1", 1, FailureKind.EXITED, "killed by signal 9", recovery=False)  # the agent gave up
    assert d.fail_job and not d.mark_dead
    m.apply_failure(c, "1", d)
    assert c.job is m.JobState.FAILED and "killed by signal 9" in c.root_cause


# --- dump planning ------------------------------------------------------------------------


def test_dump_plan_writes_dead_ranks_from_replicas_on_the_lowest_survivor():
    held = {5: frozenset({0, 1, 2}), 6: frozenset({0})}  # step 6 was not replicated
    plan, notes = plan_dump(held, 0, frozenset({2}), True)
    assert plan == [(5, 0), (6, 0), (5, 2)]
    assert "rank 2 died; its state at step 5" in notes[0]
    plan, notes = plan_dump({6: frozenset({1})}, 1, frozenset({2}), True)
    assert plan == [(6, 1)] and "no snapshot here holds its own state" in notes[0]
    assert plan_dump(held, 1, frozenset({2}), False) == ([(5, 1), (6, 1)], [])
    plan, notes = plan_dump(held, 0, None, True)
    assert plan == [(5, 0), (6, 0)] and "could not learn" in notes[0]


def test_who_died():
    status = {"nodes": [{"rank": 0, "state": "dead"}, {"rank": 1, "state": "alive"}, {"rank": 2, "state": "alive"}]}
    assert who_died(status, 1) == (frozenset({0}), True)
    assert who_died(status, 2) == (frozenset({0}), False)


# --- graceful exit --------------------------------------------------------------------------


def test_stop_request_deadline_keeps_a_margin():
    stop = StopRequest()
    stop.at = 100.0
    assert stop.deadline(10.0) == pytest.approx(109.0)  # 1 s margin at most
    assert stop.deadline(2.0) == pytest.approx(101.6)  # 20 % of short periods


# --- strategy.json --------------------------------------------------------------------------


def test_parallel_strategy_of_plain_data_parallel(tmp_path):
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    doc = parallel_strategy.describe(net, world_size=4, generation=2)
    assert doc["world_size"] == 4 and doc["mesh"] is None and doc["generation"] == 2
    assert doc["parameters"]["0.weight"] == {"shape": [3, 4], "dtype": "float32", "placement": "replicate"}
    assert set(doc["parameters"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    (path,) = parallel_strategy.write(doc, [tmp_path / "a"])
    assert path == tmp_path / "a" / "strategy.json" and '"replicate"' in path.read_text()


# --- job file -------------------------------------------------------------------------------


def _args(argv):
    return cli.build_parser().parse_args(["run", *argv])


def test_job_file_fills_flags_and_flags_win(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    job = tmp_path / "job.yaml"
    job.write_text(f"script: {script}\nscript_args: [--epochs, 3]\nnproc_per_node: 2\nmax_restarts: 5\n"
                   "recover_strategy: [retry, recover-in-place]\nmax_retries: 4\ngrace_period: 7.5\n")
    spec = cli.resolve_run(_args(["--config", str(job), "--max-restarts", "1"]), {"TG_RECOVER_STRATEGY": "exit"})
    assert spec.script == str(script) and spec.script_args == ("--epochs", "3") and spec.nproc_per_node == 2
    assert spec.max_restarts == 1 and spec.grace_s == 7.5  # the flag wins over the file
    assert str(spec.recover_strategy) == "retry,recover-in-place" and spec.recover_strategy.max_retries == 4
    spec = cli.resolve_run(_args([str(script)]), {"TG_RECOVER_STRATEGY": "retry,exit", "TG_GRACE_PERIOD": "4"})
    assert str(spec.recover_strategy) == "retry,exit" and spec.grace_s == 4.0 and spec.max_restarts == 32767


@pytest.mark.parametrize("text, expected", [
    ("workerz: 2\n", "workerz"),
    ("workers: -1\n", "workers"),
    ("recover_strategy: retry,bogus\n", "unknown recover strategy 'bogus'"),
    ("- a list\n", "mapping"),
    ("workers: [\n", "not valid YAML"),
])
def test_bad_job_files_name_the_file_and_the_key(tmp_path, text, expected):
    job = tmp_path / "job.yaml"
    job.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_job_file(job)
    assert str(job) in str(info.value) and expected in str(info.value)


def test_cli_refuses_unbuilt_strategies_and_contradictions_before_starting(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    assert cli.main(["run", "--recover-strategy", "recover,bogus", str(script)]) == 2
    assert "unknown recover strategy 'bogus'" in capsys.readouterr().err
    assert cli.main(["run", "--recover-strategy", "exit,recover-in-place", str(script)]) == 2
    assert "contradicts itself" in capsys.readouterr().err
    assert cli.main(["run", "--grace-period", "0", str(script)]) == 2
    assert "--grace-period" in capsys.readouterr().err


# --- chaos ----------------------------------------------------------------------------------


def test_chaos_picks_the_live_rank_on_this_host():
    status = {"scheduler_pid": 7, "job": "running", "generation": 3, "nodes": [
        {"node_id": "0", "rank": 0, "host": "h", "pid": 10, "state": "alive"},
        {"node_id": "1", "rank": 1, "host": "h", "pid": 11, "state": "dead"},
        {"node_id": "2", "rank": 2, "host": "other", "pid": 12, "state": "alive"}]}
    assert pick_target(status, "kill", 0, "h")[0] == 10
    assert pick_target(status, "kill-scheduler", None, "h")[0] == 7
    with pytest.raises(ConfigError, match=r"no live worker has rank 1 \(live ranks: \[0, 2\]"):
        pick_target(status, "term", 1, "h")
    with pytest.raises(ConfigError, match="runs on host 'other'"):
        pick_target(status, "stop", 2, "h")
    with pytest.raises(ConfigError, match="--rank"):
        pick_target(status, "kill", None, "h")


def test_chaos_cli_without_a_scheduler_is_a_clear_error(capsys):
    port = cli.pick_free_port("127.0.0.1")
    assert cli.main(["chaos", "--sched-port", str(port), "kill", "--rank", "0"]) == 2
    assert "cannot get the job's status" in capsys.readouterr().err

