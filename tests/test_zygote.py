"""The zygote (launch/zygote.py, forked.py, forkwire.py, proctitle.py): workers and spares forked from one
warm process. Real processes throughout: the zygote, its children, kill -9 of either."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from trainguard.errors import ProtocolError
from trainguard.launch import forkwire, proctitle
from trainguard.launch.forked import ForkedProcess, ZygoteLink, start_process
from trainguard.launch.spare_main import needs_worker_modules, top_level_imports
from trainguard.launch.zygote import parse_order

REPO = Path(__file__).resolve().parents[1]
WORKER = "trainguard.launch.worker_main"


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


def _script(tmp_path: Path, body: str, name: str = "job.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


class _Said:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)


def _link(tmp_path: Path, script: Path, env: dict[str, str] | None = None) -> tuple[ZygoteLink, _Said]:
    said = _Said()
    link = ZygoteLink(str(script), (), env or _env(), say=said, err=io.StringIO(), lock=threading.Lock(), room=512)
    return link, said


def _fds(pid: int) -> set[int]:
    return {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}


def _children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if _ppid(int(entry)) == pid:
                found.append(int(entry))
    return found


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


# --- pure pieces -------------------------------------------------------------------------------


@pytest.mark.timeout(5)
def test_a_command_line_is_cut_to_its_room_and_ends_in_nul() -> None:
    assert proctitle.encode(["python", "-m", "x"], 16) == b"python\0-m\0x\0".ljust(16, b"\0")
    cut = proctitle.encode(["python", "-m", "trainguard.launch.worker_main"], 16)
    assert len(cut) == 16 and cut.endswith(b"\0") and cut.startswith(b"python\0-m\0train")
    assert proctitle.encode(["a" * 40], 8) == b"aaaaaaa\0"


@pytest.mark.timeout(5)
def test_a_stdlib_only_script_does_not_preload_torch() -> None:
    assert not needs_worker_modules(top_level_imports("import os, sys\nfrom time import sleep\n"))
    assert needs_worker_modules(top_level_imports("import os\nimport torch.nn as nn\n"))
    assert needs_worker_modules(top_level_imports("from trainguard.train import model\n"))
    assert not needs_worker_modules(top_level_imports("import os\nimport no_such_module_tg\n"))  # it only fails


@pytest.mark.parametrize("change, why", [
    ({"main": "os"}, "runs only"),
    ({"argv": ["ok", 3]}, "argv holds a non-string"),
    ({"env": {"A": 1}}, "env holds a non-string"),
    ({"fds": [2]}, "from 3 to"),
    ({"fds": [5, 5]}, "distinct"),
    ({"fds": [True]}, "from 3 to"),
    ({"argv": "x"}, "'argv' is not a list"),
])
@pytest.mark.timeout(5)
def test_a_bad_fork_order_is_refused(change: dict, why: str) -> None:
    order = {"op": "fork", "id": 1, "main": WORKER, "argv": ["job.py"], "env": {"A": "b"}, "fds": [], **change}
    with pytest.raises(ProtocolError, match=why):
        parse_order(order, 3 + (len(order["fds"]) if isinstance(order["fds"], list) else 0))


@pytest.mark.timeout(5)
def test_an_order_must_bring_its_descriptors() -> None:
    order = {"op": "fork", "id": 1, "main": WORKER, "argv": [], "env": {}, "fds": [7]}
    assert parse_order(order, 4) == (WORKER, [], {}, [7])
    with pytest.raises(ProtocolError, match="came with 3 descriptors"):
        parse_order(order, 3)


# --- a real zygote -----------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_forked_worker_is_what_a_fresh_one_would_be_and_its_exit_reaches_the_agent(tmp_path: Path) -> None:
    """Its env, argv, command line, descriptors, session and exit code (kill -9 included); it holds nothing of
    the zygote's, so no worker (or anything it runs) can order a fork."""
    script = _script(tmp_path, """
        import os, sys, time
        import torch
        fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
        print("out", os.environ["WHO"], sys.argv[1:], torch.get_num_threads(), os.getsid(0) == os.getpid(), fds,
              flush=True)
        cmd = open("/proc/self/cmdline", "rb").read().split(b"\\0")
        print("cmd", [c.decode() for c in cmd if c], file=sys.stderr, flush=True)
        if sys.argv[2] == "sleep":
            time.sleep(60)
        sys.exit(int(sys.argv[2]))
    """)
    link, said = _link(tmp_path, script)
    try:
        assert link.wait_ready(60), said.lines
        sockets = [fd for fd in _fds(link.popen.pid) if os.readlink(f"/proc/{link.popen.pid}/fd/{fd}").startswith("socket:")]
        assert len(sockets) == 1  # its end of the agent's pair: nothing listens
        proc = link.spawn(WORKER, [str(script), "a", "7"], _env(WHO="w1"), stdin_pipe=False)
        assert isinstance(proc, ForkedProcess) and proc.pid > 0
        assert proc.wait(60) == 7
        out = proc.stdout.read().decode()
        err = proc.stderr.read().decode()
        assert "out w1 ['a', '7'] 1 True [0, 1, 2, 3]" in out, (out, err)  # 3: the listing's own descriptor
        assert f"cmd ['{sys.executable}', '-u', '-m', '{WORKER}', '{script}', 'a', '7']" in err

        proc = start_process(link, [sys.executable, "-u", "-m", WORKER, str(script), "b", "sleep"], _env(WHO="w2"))
        assert isinstance(proc, ForkedProcess)
        assert proc.stdout.readline().startswith(b"out w2")
        assert _ppid(proc.pid) == link.popen.pid
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
        with pytest.raises(subprocess.TimeoutExpired):
            ForkedProcess(["x"], None, None, None).wait(0.01)
        assert link.popen.poll() is None  # the zygote serves on
    finally:
        link.close()
    assert link.popen.returncode == 0  # EOF on its socket: it left by itself


@pytest.mark.timeout(90)
def test_when_the_zygote_dies_its_children_are_killed_and_fresh_processes_follow(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        import time
        import torch
        print("up", flush=True)
        time.sleep(60)
    """)
    link, said = _link(tmp_path, script)
    try:
        proc = start_process(link, [sys.executable, "-u", "-m", WORKER, str(script)], _env())
        assert isinstance(proc, ForkedProcess) and proc.stdout.readline() == b"up\n"
        os.kill(link.popen.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL  # no status can come any more: it was ended
        deadline = time.monotonic() + 30
        while Path(f"/proc/{proc.pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # reparented to init, which reaps it
        assert not Path(f"/proc/{proc.pid}").exists()
        assert any("is not used" in line and "1 live children were killed" in line for line in said.lines), said.lines
        fresh = start_process(link, [sys.executable, "-u", "-m", WORKER, str(script)], _env())
        assert isinstance(fresh, subprocess.Popen)
        assert fresh.stdout.readline() == b"up\n"
        fresh.kill()
        fresh.wait()
    finally:
        link.close()


@pytest.mark.timeout(90)
def test_an_import_that_starts_a_thread_makes_the_zygote_step_aside(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "busylib.py").write_text("import threading, time\n"
                                    "threading.Thread(target=time.sleep, args=(60,), name='busy', daemon=True).start()\n")
    job = tmp_path / "job"
    job.mkdir()
    script = _script(job, "import busylib\nprint('ran', flush=True)\n")
    env = _env(PYTHONPATH=f"{REPO}:{lib}")
    link, said = _link(tmp_path, script, env)
    try:
        assert not link.wait_ready(60)
        assert link.why == "forking is not safe: a preloaded import started threads (busy)"
        proc = start_process(link, [sys.executable, "-u", "-m", WORKER, str(script)], env)
        assert isinstance(proc, subprocess.Popen)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out == b"ran\n"
    finally:
        link.close()


@pytest.mark.timeout(60)
def test_the_zygote_refuses_a_bad_order_and_leaves_on_a_malformed_packet(tmp_path: Path) -> None:
    """Its own wire, driven by hand: a refused order keeps it serving; a packet that is not JSON ends it."""
    script = _script(tmp_path, "import os\n")
    mine, theirs = forkwire.pair()
    zygote = subprocess.Popen([sys.executable, "-u", "-m", forkwire.ZYGOTE_MODULE, "--fd", str(theirs.fileno()),
                               str(script)], env=_env(), pass_fds=(theirs.fileno(),), stderr=subprocess.PIPE)
    theirs.close()
    try:
        mine.settimeout(60)
        ready, _ = forkwire.recv(mine)
        assert ready["op"] == "ready" and ready["unsafe"] == ""
        null = [os.open(os.devnull, os.O_RDWR) for _ in range(3)]
        forkwire.send(mine, {"op": "fork", "id": 4, "main": "os", "argv": [], "env": {}, "fds": []}, null)
        for fd in null:
            os.close(fd)
        refused, _ = forkwire.recv(mine)
        assert refused == {"op": "refused", "id": 4, "error": refused["error"]} and "runs only" in refused["error"]
        mine.send(b"not json")
        assert zygote.wait(30) == 1
        assert b"not JSON" in zygote.stderr.read()
    finally:
        mine.close()
        if zygote.poll() is None:
            zygote.kill()
            zygote.wait()


@pytest.mark.timeout(120)
def test_run_forks_workers_from_the_zygote_and_no_zygote_starts_fresh_ones(tmp_path: Path) -> None:
    """Through `trainguard run`: each worker's parent is the zygote, or with --no-zygote the agent."""
    script = _script(tmp_path, """
        import os
        import torch
        parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\\0")
        print("parent", b"trainguard.launch.zygote" in parent, flush=True)
    """)
    for flag, forked in (([], True), (["--no-zygote"], False)):
        run = subprocess.run([sys.executable, "-m", "trainguard", "run", "--workers", "2", "--max-restarts", "0",
                              *flag, str(script)], env=_env(), cwd=tmp_path, capture_output=True, text=True,
                             timeout=100)
        assert run.returncode == 0, run.stderr
        assert run.stdout.count(f"parent {forked}") == 2, run.stdout
        assert ("zygote ready" in run.stderr) is forked


@pytest.mark.timeout(120)
def test_an_agent_killed_by_sigkill_takes_the_zygote_and_every_worker_with_it(tmp_path: Path) -> None:
    """No orphan: an agent cannot forward anything once SIGKILLed (the OOM killer, a timeout), and a worker
    left alone would wait in its next collective for good, holding its GPU and ports."""
    script = _script(tmp_path, """
        import os
        import time
        import torch
        open(f"{os.environ['TG_NODE_ID']}.pid", "w").write(str(os.getpid()))
        time.sleep(300)
    """)
    agent = subprocess.Popen([sys.executable, "-m", "trainguard", "run", "--workers", "2", "--hot-spares", "1",
                              str(script)], env=_env(), cwd=tmp_path, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = [tmp_path / f"{rank}.pid" for rank in (0, 1)]
        deadline = time.monotonic() + 90
        while not all(p.exists() and p.read_text() for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = [int(p.read_text()) for p in pids]
        zygote = _ppid(workers[0])
        assert b"trainguard.launch.zygote" in Path(f"/proc/{zygote}/cmdline").read_bytes()
        children = _children(zygote)  # the workers and the hot spare
        assert set(workers) < set(children), (workers, children)
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 30
        left = [zygote, *children]
        while left and time.monotonic() < deadline:
            left = [pid for pid in left if Path(f"/proc/{pid}").exists() and "Z" not in
                    Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]]
            time.sleep(0.05)
        assert not left, f"still running after the agent's SIGKILL: {left}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
