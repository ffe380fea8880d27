"""Heartbeats relayed by the agent (launch/relay.py, TG_HEARTBEAT_RELAY=on): real `trainguard run` jobs
recover from kill -9 and SIGSTOP bit-identically, the scheduler with the kill -9 of it, and the relay
serves nobody but the agent's own workers."""

from __future__ import annotations

import socket

import pytest
from harness import assert_identical, events, finals, launch

from trainguard.control import protocol as p
from trainguard.errors import ConfigError
from trainguard.launch.relay import BeatRelay, relay_wanted

pytestmark = pytest.mark.timeout(240)
RELAY = {"TG_HEARTBEAT_RELAY": "on"}


@pytest.fixture
def baseline(baseline_runs):
    return baseline_runs


def check(out, workers, expected, proc):
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "relaying this host's heartbeats" in proc.stderr, proc.stderr[-2000:]
    got = finals(out, workers)
    for rank in range(workers):
        assert_identical(got[rank], expected[rank], f"rank {rank}")


def test_relay_setting_is_checked():
    assert relay_wanted(None, 64) and not relay_wanted("auto", 63)
    assert relay_wanted("on", 1) and not relay_wanted("off", 10_000)
    with pytest.raises(ConfigError, match="TG_HEARTBEAT_RELAY='sometimes' is invalid"):
        relay_wanted("sometimes", 8)


@pytest.mark.parametrize("workers", [4])
def test_kill_9_with_relayed_heartbeats_is_bit_identical(tmp_path, baseline, workers):
    proc = launch(tmp_path, workers, faults="1:10:kill", extra_env=RELAY)
    check(tmp_path, workers, baseline(workers), proc)
    assert any(e["event"] == "failure_detected" and e["node"] == "1" for e in events(tmp_path))


def test_a_stopped_worker_is_fenced_through_the_relay(tmp_path, baseline):
    """SIGSTOP: the worker stops beating to its agent; the relay stops vouching for it, and the scheduler's
    heartbeat timeout fences it (nothing else would: its process and sockets stay)."""
    proc = launch(tmp_path, 3, faults="2:8:stop", extra_env=RELAY)
    check(tmp_path, 3, baseline(3), proc)
    kinds = [e["kind"] for e in events(tmp_path) if e["event"] == "failure_detected" and e["node"] == "2"]
    assert kinds and kinds[0] == "heartbeat", kinds


def test_scheduler_killed_with_relayed_heartbeats(tmp_path, baseline):
    proc = launch(tmp_path, 3, faults="0:10:sched", extra_env=RELAY)
    check(tmp_path, 3, baseline(3), proc)
    assert not any(e["event"] == "failure_detected" for e in events(tmp_path))


def test_the_relay_serves_only_its_own_workers(tmp_path):
    """This test process is no worker of the relay's agent: it is turned away before any beat is read."""
    relay = BeatRelay(("127.0.0.1", 9), "host", 0.2, secret=None, node_of_pid=lambda pid: None)
    relay.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(relay.path)
            s.sendall(p.encode(p.Heartbeat(node_id="0", incarnation=1, generation=0, step=-1)))
            try:
                got = s.recv(100)
            except ConnectionResetError:  # closed with the beat unread
                got = b""
            assert got == b"", got  # closed without an answer
    finally:
        relay.close()
