"""The scheduler as a child process of torchrun/mpirun rank 0 (control/sched_child.py), without torch:
the port it binds is learned from its pipe, a killed child is restarted on the same port (until a
crash loop), it is not restarted without recovery, and it does not outlive a killed parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from harness import wait_for

from trainguard.config import ClusterConfig, LaunchMode, Role
from trainguard.control.client import SchedulerClient
from trainguard.control.sched_child import SchedulerProcess, decide_restart
from trainguard.exitcodes import EXIT_CONFIG, EXIT_JOB_FAILED, EXIT_PREEMPTED

KILLED = -signal.SIGKILL


def alive(pid: int) -> bool:
    """From /proc (psutil is not installed): the process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def config(tmp_path: Path, *, recovery: bool = True, port: int = 0) -> ClusterConfig:
    return ClusterConfig(role=Role.WORKER, mode=LaunchMode.TORCHRUN, sched_host="127.0.0.1", sched_port=port,
                         worker_num=2, node_id="0", embedded_scheduler=True, enable_recovery=recovery,
                         recovery_path=tmp_path / "recovery" if recovery else None, connect_timeout=30)


def status(port: int) -> dict:
    client = SchedulerClient(("127.0.0.1", port), connect_timeout=10)
    try:
        return client.status()
    finally:
        client.close()


# --- the decision ---------------------------------------------------------------------------------


@pytest.mark.parametrize("code, recovery, recent, closing, again", [
    (KILLED, True, 0, False, True),       # kill -9: restarted
    (1, True, 2, False, True),            # a crash: restarted while the limit lasts
    (KILLED, True, 3, False, False),      # 3 restarts within the window: a crash loop
    (KILLED, False, 0, False, False),     # no cluster.db to reload
    (KILLED, True, 0, True, False),       # rank 0 is leaving
    (0, True, 0, False, False), (EXIT_PREEMPTED, True, 0, False, False),
    (EXIT_JOB_FAILED, True, 0, False, False), (EXIT_CONFIG, True, 0, False, False),
])
def test_decide_restart(code, recovery, recent, closing, again):
    got, why = decide_restart(code, recent_restarts=recent, limit=3, recovery=recovery, closing=closing)
    assert got is again, why
    if code == KILLED and not recovery:
        assert "TG_ENABLE_RECOVERY" in why


# --- real processes -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_killed_scheduler_child_is_restarted_on_its_port_until_the_limit(tmp_path, caplog):
    sched = SchedulerProcess(config(tmp_path), restart_limit=1)
    try:
        port = sched.start()
        assert port > 0 and status(port)["scheduler_pid"] == sched.pid
        first = sched.pid
        os.kill(first, signal.SIGKILL)
        second = wait_for(lambda: sched.pid if sched.pid != first and status(port) else None, 20, "a restart")
        assert status(port)["scheduler_pid"] == second and alive(second)
        assert len(sched.restarts) == 1 and sched.port == port
        os.kill(second, signal.SIGKILL)  # the limit (1) is used: not restarted
        assert sched.wait(timeout=10), "the supervisor must give up once the limit is used"
        assert sched.pid == second and not alive(second) and len(sched.restarts) == 1
    finally:
        sched.close()
    logged = caplog.text
    assert "restarting it on 127.0.0.1" in logged and "restart 1/1 within 3600 s" in logged
    assert "not restarted: crash loop: it failed again after 1 restart within 3600 s" in logged


@pytest.mark.timeout(60)
def test_without_recovery_a_killed_scheduler_child_is_not_restarted(tmp_path, caplog):
    sched = SchedulerProcess(config(tmp_path, recovery=False))
    try:
        sched.start()
        pid = sched.pid
        os.kill(pid, signal.SIGKILL)
        assert sched.wait(timeout=10), "the supervisor must give up at once"
        assert sched.pid == pid and sched.restarts == []
    finally:
        sched.close()
    assert "not restarted: recovery is off (TG_ENABLE_RECOVERY=0)" in caplog.text


@pytest.mark.timeout(60)
def test_a_scheduler_child_that_cannot_listen_is_a_config_error(tmp_path):
    import socket

    from trainguard.errors import ConfigError

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        sched = SchedulerProcess(config(tmp_path, port=busy.getsockname()[1]))
        with pytest.raises(ConfigError, match="exited with code 2 before it listened"):
            sched.start()
        sched.close()


PARENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from trainguard.control.sched_child import SchedulerProcess
    from trainguard.config import ClusterConfig, LaunchMode, Role
    cfg = ClusterConfig(role=Role.WORKER, mode=LaunchMode.TORCHRUN, sched_host="127.0.0.1", sched_port=0,
                        worker_num=2, node_id="0", embedded_scheduler=True, connect_timeout=30)
    sched = SchedulerProcess(cfg)
    sched.start()
    print(sched.pid, flush=True)
    time.sleep(60)
""")


@pytest.mark.timeout(60)
def test_the_scheduler_child_does_not_outlive_its_parent(tmp_path):
    """rank 0 killed with kill -9: its scheduler child ends too (PR_SET_PDEATHSIG, or polling the parent)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TG_", "MS_"))}
    parent = subprocess.Popen([sys.executable, "-c", PARENT], env=env, stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert alive(child)
        assert Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(parent.pid)
        parent.kill()
        parent.wait(10)
        wait_for(lambda: not alive(child), 10, f"the orphaned scheduler (pid {child}) to end")
    finally:
        parent.kill()
        parent.wait(10)


def test_scheduler_command_refuses_port_0_without_a_port_fd():
    proc = subprocess.run([sys.executable, "-m", "trainguard", "scheduler", "--host", "127.0.0.1", "--port", "0",
                           "--workers", "2"], capture_output=True, text=True, timeout=30,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("TG_", "MS_"))})
    assert proc.returncode == EXIT_CONFIG and "--port-fd" in proc.stderr, proc.stderr
