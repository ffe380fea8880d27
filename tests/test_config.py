"""Environment → ClusterConfig: every name, alias and launcher mode, and every bad value."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.config import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_MPI_PORT,
    ClusterConfig,
    LaunchMode,
    Role,
    check_recovery_path,
    from_env,
)
from trainguard.errors import ConfigError

WORKER = {"TG_ROLE": "worker", "TG_SCHED_HOST": "10.0.0.1", "TG_SCHED_PORT": "8118", "TG_WORKER_NUM": "4"}


def with_(base: dict, **changes: str | None) -> dict:
    env = dict(base)
    for k, v in changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def config_error(env: dict) -> str:
    with pytest.raises(ConfigError) as info:
        from_env(env)
    return str(info.value)


# --- dynamic launch: TG_* and MS_* ------------------------------------------------------


def test_tg_names_give_a_worker_config():
    cfg = from_env(with_(WORKER, TG_NODE_ID="w-1", TG_ENABLE_RECOVERY="true", TG_RECOVERY_PATH="/tmp/rec",
                         TG_HEARTBEAT_INTERVAL="0.25", TG_HEARTBEAT_TIMEOUT="3", TG_BACKEND=" GLOO ",
                         TG_LOCAL_RANK="1", TG_FLAP_LIMIT="2"))
    assert cfg.role is Role.WORKER and cfg.mode is LaunchMode.DYNAMIC
    assert (cfg.sched_host, cfg.sched_port, cfg.worker_num, cfg.node_id) == ("10.0.0.1", 8118, 4, "w-1")
    assert cfg.address == "10.0.0.1:8118"
    assert cfg.enable_recovery and cfg.recovery_path == Path("/tmp/rec")
    assert (cfg.heartbeat_interval, cfg.heartbeat_timeout) == (0.25, 3.0)
    assert (cfg.backend, cfg.local_rank, cfg.flap_limit) == ("gloo", 1, 2)
    assert not cfg.embedded_scheduler


def test_defaults_when_optional_names_are_unset():
    cfg = from_env(WORKER)
    assert cfg.node_id is None and not cfg.enable_recovery and cfg.recovery_path is None
    assert cfg.heartbeat_interval == DEFAULT_HEARTBEAT_INTERVAL_S and cfg.backend == "auto"


@pytest.mark.parametrize("role, expected", [("MS_SCHED", Role.SCHEDULER), ("MS_WORKER", Role.WORKER)])
def test_mindspore_names(role, expected):
    env = {"MS_ROLE": role, "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "9000", "MS_WORKER_NUM": "2",
           "MS_NODE_ID": "3", "MS_ENABLE_RECOVERY": "1", "MS_RECOVERY_PATH": "/tmp/ms"}
    cfg = from_env(env)
    assert cfg.role is expected and cfg.mode is LaunchMode.DYNAMIC
    assert (cfg.sched_port, cfg.worker_num, cfg.node_id) == (9000, 2, "3")
    assert cfg.enable_recovery and cfg.recovery_path == Path("/tmp/ms")


def test_aliases_with_equal_values_are_accepted():
    cfg = from_env(with_(WORKER, MS_WORKER_NUM="4", MS_ROLE="MS_WORKER"))
    assert cfg.worker_num == 4 and cfg.role is Role.WORKER


@pytest.mark.parametrize("alias, value", [("MS_WORKER_NUM", "8"), ("MS_ROLE", "MS_SCHED"), ("MS_SCHED_PORT", "1")])
def test_conflicting_aliases_name_both_variables(alias, value):
    msg = config_error(with_(WORKER, **{alias: value}))
    assert alias.replace("MS_", "TG_") in msg and alias in msg and "conflicting" in msg


def test_no_cluster_environment_says_what_to_set():
    msg = config_error({})
    assert "TG_ROLE" in msg and "TG_SCHED_HOST" in msg and "torchrun" in msg


@pytest.mark.parametrize("name", ["TG_SCHED_HOST", "TG_SCHED_PORT", "TG_WORKER_NUM"])
def test_missing_variable_is_named(name):
    msg = config_error(with_(WORKER, **{name: None}))
    assert name in msg and "not set" in msg


@pytest.mark.parametrize("name, value, expected", [
    ("TG_SCHED_PORT", "70000", "1..65535"),
    ("TG_SCHED_PORT", "0", "1..65535"),
    ("TG_SCHED_PORT", "http", "1..65535"),
    ("TG_WORKER_NUM", "two", "integer"),
    ("TG_WORKER_NUM", "0", "in 1..1048576"),
    ("TG_WORKER_NUM", "9223372036854775808", "in 1..1048576"),
    ("TG_WORKER_NUM", "1.5", "integer"),
    ("TG_ROLE", "master", "scheduler or worker"),
    ("TG_NODE_ID", "node one", "A-Z"),
    ("TG_NODE_ID", "x" * 65, "1-64"),
    ("TG_ENABLE_RECOVERY", "maybe", "1/0"),
    ("TG_HEARTBEAT_INTERVAL", "fast", "seconds > 0"),
    ("TG_HEARTBEAT_TIMEOUT", "-1", "seconds > 0"),
    ("TG_CONNECT_TIMEOUT", "0", "seconds > 0"),
    ("TG_JOIN_TIMEOUT", "nan", "seconds > 0"),
    ("TG_BACKEND", "mpi", "gloo"),
    ("TG_LOCAL_RANK", "-1", "integer"),
    ("TG_FLAP_LIMIT", "0", ">= 1"),
])
def test_invalid_value_names_the_variable_and_the_form(name, value, expected):
    msg = config_error(with_(WORKER, **{name: value}))
    assert name in msg, msg
    assert expected in msg, msg
    if name != "TG_BACKEND":
        assert repr(value) in msg, msg


def test_mindspore_alias_is_named_in_its_own_error():
    env = {"MS_ROLE": "MS_WORKER", "MS_SCHED_HOST": "h", "MS_SCHED_PORT": "99999", "MS_WORKER_NUM": "2"}
    assert "MS_SCHED_PORT" in config_error(env)


@pytest.mark.parametrize("timeout", ["0.5", "0.4"])
def test_heartbeat_timeout_must_exceed_interval(timeout):
    msg = config_error(with_(WORKER, TG_HEARTBEAT_INTERVAL="0.5", TG_HEARTBEAT_TIMEOUT=timeout))
    assert "TG_HEARTBEAT_TIMEOUT" in msg and "TG_HEARTBEAT_INTERVAL" in msg and "exceed" in msg


def test_recovery_on_needs_a_path():
    msg = config_error(with_(WORKER, TG_ENABLE_RECOVERY="1"))
    assert "TG_ENABLE_RECOVERY" in msg and "TG_RECOVERY_PATH" in msg


def test_config_is_checked_when_built_directly():
    with pytest.raises(ConfigError, match="65535"):
        ClusterConfig(role=Role.WORKER, mode=LaunchMode.DYNAMIC, sched_host="h", sched_port=70000, worker_num=1)
    with pytest.raises(ConfigError, match="worker count"):
        ClusterConfig(role=Role.WORKER, mode=LaunchMode.DYNAMIC, sched_host="h", sched_port=1, worker_num=0)


# --- torchrun and OpenMPI ------------------------------------------------------------------


def test_torchrun_rank_0_hosts_the_scheduler():
    cfg = from_env({"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29500",
                    "LOCAL_RANK": "0"})
    assert cfg.mode is LaunchMode.TORCHRUN and cfg.role is Role.WORKER
    assert (cfg.worker_num, cfg.node_id, cfg.sched_host, cfg.local_rank) == (3, "0", "10.1.1.1", 0)
    assert cfg.sched_port == 0  # published through torchrun's own store
    assert cfg.embedded_scheduler


def test_torchrun_other_ranks_do_not_host_it():
    cfg = from_env({"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "TG_SCHED_PORT": "7000"})
    assert (cfg.node_id, cfg.local_rank, cfg.sched_port, cfg.sched_host) == ("2", 1, 7000, "127.0.0.1")
    assert not cfg.embedded_scheduler


def test_mpi_rank_0_hosts_the_scheduler():
    cfg = from_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                    "TG_SCHED_HOST": "node0"})
    assert cfg.mode is LaunchMode.MPI and cfg.embedded_scheduler
    assert (cfg.worker_num, cfg.node_id, cfg.sched_host, cfg.sched_port, cfg.local_rank) == (
        2, "0", "node0", DEFAULT_MPI_PORT, 0)
    other = from_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    assert not other.embedded_scheduler and other.node_id == "1"


def test_tg_role_wins_over_torchrun_variables():
    assert from_env({**WORKER, "RANK": "0", "WORLD_SIZE": "4"}).mode is LaunchMode.DYNAMIC


@pytest.mark.parametrize("env, name", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "a"}, "LOCAL_RANK"),
    ({"RANK": "0", "WORLD_SIZE": "2", "TG_SCHED_PORT": "65536"}, "TG_SCHED_PORT"),
    ({"OMPI_COMM_WORLD_RANK": "-2", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK"),
])
def test_launcher_variables_are_validated(env, name):
    assert name in config_error(env)


@pytest.mark.parametrize("env, names", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, ("RANK", "WORLD_SIZE")),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "4"}, ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")),
])
def test_rank_not_below_world_size_names_both_variables(env, names):
    msg = config_error(env)
    assert all(n in msg for n in names), msg


# --- the recovery path -----------------------------------------------------------------------


def test_check_recovery_path_creates_the_directory(tmp_path):
    target = tmp_path / "a" / "b"
    assert check_recovery_path(target) == target and target.is_dir()
    assert list(target.iterdir()) == []  # the write probe is removed


def test_check_recovery_path_under_a_regular_file_is_a_config_error(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(ConfigError) as info:
        check_recovery_path(blocker / "recovery")
    msg = str(info.value)
    assert str(blocker / "recovery") in msg and "not writable" in msg and "TG_RECOVERY_PATH" in msg


def test_check_recovery_path_that_is_a_file_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="TG_RECOVERY_PATH"):
        check_recovery_path(blocker)
