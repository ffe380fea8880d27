"""The agent (`trainguard run`): decisions as pure functions, then real processes on loopback.

Worker scripts here never call trainguard.init(); the scheduler child is a dummy process
(Supervisor's scheduler command is injectable), or absent (node rank 1 of 2).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainguard.config import Role
from trainguard.errors import ConfigError
from trainguard.launch import cli
from trainguard.launch.policy import (
    Action,
    Failure,
    LaunchSpec,
    decide_exit,
    describe_exit,
    exit_code_for,
    failure_summary,
    scheduler_env,
    signal_exit_code,
    worker_env,
)
from trainguard.obs.events import EventLog

REPO = Path(__file__).resolve().parents[1]

# --- pure decisions ----------------------------------------------------------------------


@pytest.mark.timeout(5)
def test_decide_exit() -> None:
    assert decide_exit(Role.WORKER, 0, 0, 3).action is Action.FINISHED
    assert decide_exit(Role.WORKER, 3, 0, 3).action is Action.RESTART
    assert decide_exit(Role.WORKER, -9, 2, 3).reason == "restart 3/3"
    assert decide_exit(Role.WORKER, -9, 3, 3).action is Action.GIVE_UP
    assert "--max-restarts 0" in decide_exit(Role.WORKER, 1, 0, 0).reason
    assert decide_exit(Role.SCHEDULER, -9, 0, 3).action is Action.RESTART
    assert decide_exit(Role.SCHEDULER, 1, 0, 3).action is Action.RESTART
    assert decide_exit(Role.SCHEDULER, 2, 0, 3).action is Action.GIVE_UP  # config error: a restart cannot help
    assert decide_exit(Role.SCHEDULER, 3, 0, 3).action is Action.GIVE_UP  # it ended the job as failed
    assert decide_exit(Role.SCHEDULER, 0, 0, 3).action is Action.FINISHED


@pytest.mark.timeout(5)
def test_exit_descriptions_and_codes() -> None:
    assert describe_exit("worker 1", 1234, 3) == "worker 1 (pid 1234) exited with code 3"
    assert describe_exit("worker 1", 1234, -9) == "worker 1 (pid 1234) was killed by signal SIGKILL"
    assert exit_code_for(3) == 3 and exit_code_for(-9) == 1
    assert signal_exit_code(signal.SIGTERM) == 143
    root = Failure("worker 1", 1234, -9, ("Traceback", "ValueError: x"))
    assert failure_summary(root, 3).splitlines()[0] == (
        "trainguard: giving up after 3 restarts; root cause: worker 1 (pid 1234) was killed by signal SIGKILL")
    assert failure_summary(root, 0).splitlines()[-1] == "    ValueError: x"
    assert failure_summary(Failure("scheduler", 7, 4, (), Role.SCHEDULER), 0) == (
        "trainguard: scheduler (pid 7) exited with code 4")
    verdict = failure_summary(Failure("scheduler", 7, 3, ("job failed: worker 2",), Role.SCHEDULER), 1)
    assert "ended the job as failed" in verdict and verdict.endswith("    job failed: worker 2")


@pytest.mark.timeout(5)
def test_child_env() -> None:
    spec = LaunchSpec(script="x.py", nproc_per_node=2, nnodes=3, node_rank=2, sched_host="h", sched_port=9,
                      max_restarts=1, recovery_path=Path("/r"))
    base = {"MS_WORKER_NUM": "99", "MS_ROLE": "MS_WORKER", "OMP_NUM_THREADS": "4", "KEEP": "1"}
    env = worker_env(base, spec, 1)
    assert env["TG_ROLE"] == "worker" and env["TG_NODE_ID"] == "5" and env["TG_LOCAL_RANK"] == "1"
    assert env["TG_WORKER_NUM"] == "6" and env["TG_SCHED_HOST"] == "h" and env["TG_SCHED_PORT"] == "9"
    assert env["TG_ENABLE_RECOVERY"] == "1" and env["TG_RECOVERY_PATH"] == "/r"
    assert env["OMP_NUM_THREADS"] == "4" and env["KEEP"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert "MS_WORKER_NUM" not in env and "MS_ROLE" not in env  # aliases must not conflict
    assert worker_env({}, spec, 0)["OMP_NUM_THREADS"] == "1"
    sched = scheduler_env({"TG_NODE_ID": "3"}, spec)
    assert sched["TG_ROLE"] == "scheduler" and "TG_NODE_ID" not in sched and sched["TG_WORKER_NUM"] == "6"
    off = LaunchSpec(script="x.py", sched_port=9, max_restarts=0)
    assert worker_env({"TG_RECOVERY_PATH": "/old"}, off, 0)["TG_ENABLE_RECOVERY"] == "0"


@pytest.mark.timeout(5)
def test_a_dying_gasp_in_a_temporary_recovery_folder_is_resumed_by_naming_it() -> None:
    """A blind port stopped with SIGTERM and ran the same command again: its dying gasp was in the first run's
    temporary folder, the rerun made a new one and resumed from the script's own older checkpoint (other weights).
    The last line now names the folder to resume from."""
    from pathlib import Path

    from trainguard.launch.policy import ended_exit, signalled_exit

    temporary = LaunchSpec(script="x.py", sched_port=9, recovery_path=Path("/tmp/trainguard-abc"),
                           recovery_temporary=True)
    code, line = ended_exit(True, [], None, 0, True, temporary.rerun)
    assert code == 75 and "run the same command with --recovery-path /tmp/trainguard-abc to resume from its dying-gasp" in line
    _, line = signalled_exit([75, 75], signal.SIGTERM, True, temporary.rerun)
    assert "--recovery-path /tmp/trainguard-abc" in line
    named = LaunchSpec(script="x.py", sched_port=9, recovery_path=Path("/data/rec"))
    assert "run the same command again to resume" in ended_exit(True, [], None, 0, True, named.rerun)[1]


@pytest.mark.timeout(5)
def test_spec_errors_name_the_flag() -> None:
    for kwargs, flag in [({"nproc_per_node": 0}, "--nproc-per-node"), ({"node_rank": 1}, "--node-rank"),
                         ({"max_restarts": -1}, "--max-restarts"), ({"sched_port": 70000}, "--sched-port")]:
        with pytest.raises(ConfigError, match=flag):
            LaunchSpec(script="x.py", **kwargs)


# --- the CLI's checks at start ---------------------------------------------------------------


@pytest.mark.timeout(10)
def test_port_in_use_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "ok.py"
    script.write_text("print('never runs')\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc = cli.main(["run", "--sched-port", str(port), "--max-restarts", "0", str(script)])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"port {port}" in err and "already in use" in err and "--sched-port" in err


@pytest.mark.timeout(10)
def test_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", str(tmp_path / "missing.py")]) == 2
    assert "not found" in capsys.readouterr().err
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    assert cli.main(["run", "--nnodes", "2", "--node-rank", "1", str(script)]) == 2
    assert "--sched-host" in capsys.readouterr().err
    assert cli.main(["run", "--nproc-per-node", "0", str(script)]) == 2
    assert "--nproc-per-node" in capsys.readouterr().err


# --- real processes ----------------------------------------------------------------------------

DRIVER = """
import json, sys
from pathlib import Path
from trainguard.launch.agent import LaunchSpec, Supervisor
kw = json.loads(sys.argv[1])
sched = kw.pop("scheduler_cmd")
kw["script_args"] = tuple(kw.get("script_args", ()))
for key in ("recovery_path", "log_dir"):
    kw[key] = Path(kw[key]) if kw.get(key) else None
sys.exit(Supervisor(LaunchSpec(**kw), scheduler_cmd=sched).run())
"""
SLEEPY_SCHEDULER = "import time; print('scheduler up', flush=True); time.sleep(60)"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _script(tmp_path: Path, body: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _agent(tmp_path: Path, script: Path, *, scheduler: str = SLEEPY_SCHEDULER, **kw: object) -> subprocess.Popen:
    spec = {"script": str(script), "nproc_per_node": 2, "sched_port": 1, "max_restarts": 0,
            "recovery_path": str(tmp_path / "rec"), "sched_exit_wait_s": 0.2, "grace_s": 5.0,
            "scheduler_cmd": [sys.executable, "-c", scheduler], **kw}
    return subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(spec)], cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 15.0) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.mark.timeout(20)
def test_every_line_is_prefixed_and_env_is_set(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        import os, sys, time
        while not os.path.exists("scheduler_up"):  # the job ends once the workers do: let the scheduler speak first
            time.sleep(0.05)
        print("hello", os.environ["TG_NODE_ID"], os.environ["TG_LOCAL_RANK"], os.environ["TG_WORKER_NUM"],
              os.environ["TG_ROLE"], os.environ["OMP_NUM_THREADS"], sys.argv[1:])
        print("second line")
        print("to stderr", file=sys.stderr)
    """)
    scheduler = "import pathlib, time; print('scheduler up', flush=True); pathlib.Path('scheduler_up').touch(); time.sleep(60)"
    rc, out, err = _finish(_agent(tmp_path, script, scheduler=scheduler, script_args=["--lr", "0.1"],
                                  log_dir=str(tmp_path / "logs")))
    assert rc == 0, err
    assert "[worker 0] hello 0 0 2 worker 1 ['--lr', '0.1']" in out
    assert "[worker 1] hello 1 1 2 worker 1 ['--lr', '0.1']" in out
    assert "[scheduler] scheduler up" in out
    assert all(ln.startswith(("[worker 0] ", "[worker 1] ", "[scheduler] ")) for ln in out.splitlines())
    assert all(ln.startswith(("[worker 0] ", "[worker 1] ", "[scheduler] ", "[agent] ")) for ln in err.splitlines())
    assert err.count("to stderr") == 2
    assert (tmp_path / "logs" / "worker_1.log").read_text().count("\n") == 3


@pytest.mark.timeout(20)
def test_worker_exit_code_names_worker_and_traceback(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        import os, sys, time, traceback
        if os.environ["TG_NODE_ID"] == "1":
            try:
                raise RuntimeError("boom in worker 1")
            except RuntimeError:
                traceback.print_exc()
            sys.exit(3)
        time.sleep(600)
    """)
    rc, _, err = _finish(_agent(tmp_path, script))  # worker 0 sleeps 600 s: the job ended, so it was stopped
    assert rc == 3
    assert "stopping the job" in err, err[-2000:]
    summary = err[err.index("trainguard: worker 1 (pid "):]
    assert "exited with code 3" in summary.splitlines()[0]
    assert "RuntimeError: boom in worker 1" in summary


@pytest.mark.timeout(20)
def test_uncaught_exception_via_cli_without_scheduler(tmp_path: Path) -> None:
    """Node rank 1 of 2 starts no scheduler; `python -m trainguard run` end to end."""
    script = _script(tmp_path, "raise ValueError('bad batch')\n")
    port = cli.pick_free_port("127.0.0.1")
    proc = subprocess.run([sys.executable, "-m", "trainguard", "run", "--nnodes", "2", "--node-rank", "1",
                           "--sched-host", "127.0.0.1", "--sched-port", str(port), "--max-restarts", "0",
                           str(script)], cwd=tmp_path, env={**_env(), "TG_JOB_SECRET": "s" * 32},
                          capture_output=True, text=True, timeout=15)
    assert proc.returncode == 1
    assert "[scheduler]" not in proc.stdout + proc.stderr and "starting scheduler" not in proc.stderr
    summary = proc.stderr[proc.stderr.index("trainguard: worker 1 (pid "):]
    assert "exited with code 1" in summary and "ValueError: bad batch" in summary


@pytest.mark.timeout(20)
def test_sigkill_restarts_then_gives_up(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        import os, signal, time
        print("started", flush=True)
        if os.environ["TG_NODE_ID"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)
    """)
    rc, out, err = _finish(_agent(tmp_path, script, max_restarts=2))
    assert rc == 1
    assert "[agent] restarting worker 0 (restart 1/2)" in err
    assert "[agent] restarting worker 0 (restart 2/2)" in err
    assert out.count("[worker 0] started") == 3 and out.count("[worker 1] started") == 1
    assert "trainguard: giving up after 2 restarts; root cause: worker 0 (pid " in err
    assert "was killed by signal SIGKILL" in err


@pytest.mark.timeout(20)
def test_scheduler_crash_is_restarted_in_place(tmp_path: Path) -> None:
    crashing = ("import os, pathlib, signal, time\n"
                f"mark = pathlib.Path({str(tmp_path / 'crashed')!r})\n"
                "print('scheduler port', os.environ['TG_SCHED_PORT'], flush=True)\n"
                "if not mark.exists():\n    mark.touch(); os.kill(os.getpid(), signal.SIGKILL)\n"
                "time.sleep(60)\n")
    script = _script(tmp_path, "import time; time.sleep(1.5); print('done')\n")
    rc, out, err = _finish(_agent(tmp_path, script, scheduler=crashing, sched_port=4567, max_restarts=1))
    assert rc == 0, err
    assert "[agent] restarting scheduler (restart 1/1)" in err
    assert out.count("[scheduler] scheduler port 4567") == 2


@pytest.mark.timeout(20)
@pytest.mark.parametrize("code", [2, 3])
def test_scheduler_verdicts_are_not_restarted(tmp_path: Path, code: int) -> None:
    """2: the scheduler rejected its config; 3: it ended the job as failed. Restarting helps neither."""
    script = _script(tmp_path, "import time; time.sleep(30)\n")
    sched = f"import sys, time; time.sleep(0.5); print('job failed: worker 1', file=sys.stderr); sys.exit({code})"
    rc, _, err = _finish(_agent(tmp_path, script, scheduler=sched, max_restarts=3))
    assert rc == code and "restarting" not in err
    summary = err[err.index("trainguard: "):]
    assert "scheduler (pid " in summary and summary.rstrip().endswith("job failed: worker 1")


def _read_until(proc: subprocess.Popen, wanted: set[str], timeout: float = 10.0) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while wanted - set(seen) and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line.rstrip("\n"))
    assert not wanted - set(seen), seen
    return seen


@pytest.mark.timeout(20)
def test_sigterm_is_forwarded_workers_first(tmp_path: Path) -> None:
    script = _script(tmp_path, f"""
        import os, pathlib, signal, sys, time
        def on_term(signum, frame):
            print("saving", flush=True)
            pathlib.Path({str(tmp_path)!r}, "saved-" + os.environ["TG_NODE_ID"]).touch()
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        print("ready", flush=True)
        time.sleep(30)
    """)
    scheduler = ("import pathlib, signal, sys, time\n"
                 "def on_term(s, f):\n"
                 f"    n = len(list(pathlib.Path({str(tmp_path)!r}).glob('saved-*')))\n"
                 "    print('scheduler saw', n, 'saved', flush=True); sys.exit(0)\n"
                 "signal.signal(signal.SIGTERM, on_term)\ntime.sleep(60)\n")
    proc = _agent(tmp_path, script, scheduler=scheduler)
    _read_until(proc, {"[worker 0] ready", "[worker 1] ready"})
    proc.send_signal(signal.SIGTERM)
    rc, out, err = _finish(proc)
    assert rc == 128 + signal.SIGTERM, err
    assert "[worker 0] saving" in out and "[worker 1] saving" in out
    assert "[scheduler] scheduler saw 2 saved" in out
    assert "received SIGTERM" in err


@pytest.mark.timeout(20)
def test_sigkill_after_grace_period(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(600)
    """)
    proc = _agent(tmp_path, script, nproc_per_node=1, grace_s=0.5)
    _read_until(proc, {"[worker 0] ready"})
    proc.send_signal(signal.SIGINT)
    rc, _, _ = _finish(proc)  # the worker ignores SIGTERM and sleeps 600 s: it ended, so the grace's SIGKILL came
    assert rc == 128 + signal.SIGINT


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delay", [0.0, 1.5])
def test_worker_killed_after_its_goodbye_is_not_restarted(tmp_path: Path, delay: float) -> None:
    """A worker that dies after it told the scheduler it finished has nothing left to redo: it is not
    restarted (a restarted one would only be refused as too late), whether the scheduler still runs
    (it answers the exit report: already finished) or has ended the job (it exited 0)."""
    script = _script(tmp_path, f"""
        import os, signal, time
        import trainguard as tg
        rt = tg.init()
        time.sleep(0.5)  # both ends finish building the group (else a peer's build can fail on our goodbye)
        rt.finish()
        print("said goodbye", flush=True)
        if tg.get_rank() == 1:
            time.sleep({delay})
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-m", "trainguard", "run", "--workers", "2", "--hot-spares", "0",
                           "--recovery-path", str(tmp_path / "rec"), str(script)], cwd=tmp_path,
                          env={**_env(), "OMP_NUM_THREADS": "1", "TG_HEARTBEAT_INTERVAL": "0.2"},
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("said goodbye") == 2
    assert "worker 1 is not restarted: " in proc.stderr, proc.stderr[-3000:]
    assert "restarting worker 1" not in proc.stderr


@pytest.mark.timeout(90)
def test_the_scheduler_ends_with_an_agent_killed_by_sigkill(tmp_path: Path) -> None:
    """No orphan: a scheduler whose agent died of SIGKILL (nothing forwarded, nothing cleaned up) ends too,
    so it never holds the port or waits forever for workers nobody supervises."""
    script = _script(tmp_path, "import time, trainguard as tg\ntg.init()\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-m", "trainguard", "run", "--workers", "1", "--hot-spares", "0",
                             "--recovery-path", str(tmp_path / "rec"), str(script)], cwd=tmp_path,
                            env={**_env(), "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        def scheduler_pid():
            path = tmp_path / "rec" / "events.jsonl"
            started = [e for e in EventLog.read(path) if e["event"] == "scheduler_started"] if path.exists() else []
            return started[0]["pid"] if started else None

        pid = _wait_until(scheduler_pid, 60)
        workers += [c for c in _children(proc.pid) if c != pid]  # in their own sessions: ours to clean up below
        proc.kill()
        proc.wait(10)
        assert _wait_until(lambda: not _alive(pid), 20), f"the scheduler (pid {pid}) outlived its agent"
    finally:
        if proc.poll() is None:
            proc.kill()
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _wait_until(predicate, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    return None
