"""Heartbeats relayed by the agent (launch/relay.py, TG_HEARTBEAT_RELAY=on): real `trainguard run` jobs
recover bit-identically from a SIGSTOP (which only the relayed heartbeats can reveal) and from kill -9 of
the scheduler, and the relay serves nobody but the agent's own workers. (A worker's kill -9 is seen by the
agent's waitpid, relay or not; bench/scheduler_scale.py measures the relay at 10,000 workers.)"""

from __future__ import annotations

import socket

import pytest
from harness import assert_identical, deaths, events, finals, launch

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


def test_a_stopped_worker_is_fenced_through_the_relay_and_the_relay_outlives_the_scheduler(tmp_path, baseline):
    """SIGSTOP: the worker stops beating to its agent; the relay stops vouching for it, and the scheduler's
    heartbeat timeout fences it (nothing else would: its process and sockets stay). Later the scheduler is
    killed: the relay reconnects to the new one, and no live worker is taken for dead."""
    proc = launch(tmp_path, 3, faults="2:6:stop,0:16:sched", extra_env=RELAY, spares=0)
    check(tmp_path, 3, baseline(3), proc)
    assert deaths(events(tmp_path)) == [("2", "heartbeat")], events(tmp_path)
    assert "restarting scheduler" in proc.stdout + proc.stderr


def test_the_relay_serves_only_its_own_workers(tmp_path):
    """This test process is no worker of the relay's agent: it is turned away before any beat is read."""
    relay = BeatRelay(("127.0.0.1", 9), "host", 0.2, secret=None, node_of_pid=lambda pid: None)
    relay.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(relay.path)
            try:
                s.sendall(p.encode(p.Heartbeat(node_id="0", incarnation=1, generation=0, step=-1)))
                got = s.recv(100)
            except (BrokenPipeError, ConnectionResetError):  # closed before the beat was sent, or with it unread
                got = b""
            assert got == b"", got  # closed without an answer
    finally:
        relay.close()
