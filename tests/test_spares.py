"""Hot spares: the spare process on its own, the agent's SparePool, and a Supervisor restarting a
worker from a spare. Real processes; the scheduler child is a dummy, as in test_launcher.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from harness import wait_for

from trainguard.launch import cli
from trainguard.launch.policy import LaunchSpec, spare_env
from trainguard.launch.spare_main import calls_compile, top_level_imports
from trainguard.launch.spare_pool import SparePool, activate

REPO = Path(__file__).resolve().parents[1]
SPARE = [sys.executable, "-u", "-m", "trainguard.launch.spare_main"]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


def _script(tmp_path: Path, body: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _spare_pids(script: Path) -> list[int]:
    """Live (not zombie) spare processes for this script, found in /proc."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"trainguard.launch.spare_main" in cmd and str(script).encode() in cmd and state != "Z":
            pids.append(int(proc.name))
    return pids


def _order(env: dict[str, str], argv: list[str]) -> str:
    return json.dumps({"env": env, "argv": argv}) + "\n"


# --- the spare process ---------------------------------------------------------------------


@pytest.mark.timeout(5)
def test_top_level_imports() -> None:
    source = textwrap.dedent("""
        import os, torch.nn as nn
        from sklearn.datasets import load_digits
        from . import sibling
        from x import *
        def f():
            import inside_a_function
        if True:
            import not_top_level
    """)
    assert top_level_imports(source) == [("os", ()), ("torch.nn", ()), ("sklearn.datasets", ("load_digits",)),
                                         ("x", ())]


@pytest.mark.timeout(5)
def test_a_script_that_calls_torch_compile_is_told_apart() -> None:
    """Its spares and zygote preload torch.compile's machinery (COMPILE_MODULES): 1.8 s a replacement would pay."""
    assert calls_compile("import torch\nmodel = torch.compile(model)")
    assert calls_compile("import torch\nif compile:\n    model = torch.compile(model, mode='max-autotune')")
    assert calls_compile("from torch import compile\ndef f(m):\n    return compile(m)")
    assert not calls_compile("code = compile(source, 'f.py', 'exec')")  # Python's own
    assert not calls_compile("import torch\nx = torch.ones(1)  # torch.compile in a comment")


@pytest.mark.timeout(120)  # against hangs only: a spare imports torch, which takes tens of seconds on a busy machine
def test_spare_runs_the_script_like_python_does(tmp_path: Path) -> None:
    ok = _script(tmp_path, """
        import os, sys
        import json
        print(sys.argv[1:], os.environ.get("TG_NODE_ID"), os.environ.get("LEFT_OVER"), __name__,
              os.path.basename(__file__), sys.path[0] == os.path.dirname(os.path.abspath(__file__)),
              "torch" in sys.modules, sys.stdin.read() == "")
        sys.exit(7)
    """, "ok.py")
    bad = _script(tmp_path, "import json\n\ndef f():\n    raise ValueError('bad batch')\n\nf()\n", "bad.py")
    # all three at once: each pays for importing torch
    procs = [subprocess.Popen([*SPARE, str(path)], cwd=tmp_path, env=_env(LEFT_OVER="spare's own env"),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for path in (ok, bad, ok)]
    orders = [_order({"TG_NODE_ID": "5", "PATH": os.environ["PATH"]}, ["--lr", "0.1"]),
              _order({"PATH": os.environ["PATH"]}, []), ""]  # the last one is dismissed: EOF
    results = [p.communicate(order, timeout=100) for p, order in zip(procs, orders)]
    (out, err), (_, bad_err), (dismissed_out, dismissed_err) = results
    assert procs[0].returncode == 7, err
    assert out == "['--lr', '0.1'] 5 None __main__ ok.py True True True\n"
    assert procs[1].returncode == 1
    assert bad_err.startswith("Traceback (most recent call last):\n") and "ValueError: bad batch" in bad_err
    assert "runpy" not in bad_err and "spare_main.py" not in bad_err  # only the script's own frames
    assert bad_err == subprocess.run([sys.executable, str(bad)], capture_output=True, text=True).stderr
    assert procs[2].returncode == 0 and dismissed_out == dismissed_err == ""


def test_a_worker_ends_as_python_would_without_tearing_down_its_modules(tmp_path: Path) -> None:
    """worker_main ends with os._exit after the script: what the interpreter's own end would do must
    still happen (threading's exit hooks run, threads joined, open files flushed, atexit handlers run, the
    exit code or message). A threading exit hook is how a checkpoint's last save, written by a daemon
    thread, is waited for (train/state/checkpointing.py): without it, the save was cut."""
    script = _script(tmp_path, """
        import atexit, sys, threading, time
        from trainguard.train.state.checkpointing import when_main_thread_ends
        log = open("unclosed.txt", "w")
        log.write("written, never closed")
        def late():
            time.sleep(0.3)
            print("thread done\\n", end="", flush=True)  # one write: the two threads' lines never interleave
        threading.Thread(target=late).start()
        saved = threading.Event()
        def save():
            time.sleep(0.3)
            print("save done\\n", end="", flush=True)
            saved.set()
        threading.Thread(target=save, daemon=True).start()
        when_main_thread_ends(saved.wait, 10)  # as ModelCheckpoint waits for its last save
        atexit.register(lambda: print("atexit ran"))
        print("buffered, no flush", end="")
        sys.exit(sys.argv[1] if sys.argv[1:] else None)
    """, "ends.py")
    for arg, code, err in (([], 0, ""), (["bye"], 1, "bye\n")):
        proc = subprocess.run([sys.executable, "-m", "trainguard.launch.worker_main", str(script), *arg],
                              cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=100)
        assert (proc.returncode, proc.stderr) == (code, err), proc.stderr
        assert proc.stdout.startswith("buffered, no flush") and proc.stdout.endswith("atexit ran\n"), proc.stdout
        assert sorted(proc.stdout[len("buffered, no flush"):].splitlines()) == ["atexit ran", "save done",
                                                                              "thread done"], proc.stdout
        assert (tmp_path / "unclosed.txt").read_text() == "written, never closed"


# --- the pool ------------------------------------------------------------------------------


@pytest.mark.timeout(120)  # against hangs only: a spare imports torch, which takes tens of seconds on a busy machine
def test_pool_take_replace_close(tmp_path: Path) -> None:
    script = _script(tmp_path, "import os, sys\nprint('activated', os.environ['TG_NODE_ID'], sys.argv[1:])\n")
    said: list[str] = []
    pool = SparePool(str(script), _env(), 1, say=said.append)
    seen: set[int] = set()
    try:
        pool.start()
        assert pool.wait_ready(15), said
        first = pool.idle_pids
        seen.update(first)
        spare = pool.take()
        assert spare is not None and [spare.pid] == first
        deadline = time.monotonic() + 5
        while not pool.idle_pids and time.monotonic() < deadline:  # its successor starts at once
            time.sleep(0.01)
        assert pool.idle_pids and pool.idle_pids != first
        seen.update(pool.idle_pids)
        activate(spare, {**_env(), "TG_NODE_ID": "3"}, ["--x"])
        assert spare.stdout is not None and spare.wait(10) == 0
        assert spare.stdout.read() == b"activated 3 ['--x']\n"
        assert any(m.startswith(f"hot spare ready (pid {first[0]}") for m in said)
    finally:
        pool.close()
    assert pool.take() is None
    assert not _spare_pids(script)
    assert all(not Path(f"/proc/{pid}").exists() for pid in seen)  # reaped, not zombies


@pytest.mark.timeout(120)  # against hangs only: a spare imports torch, which takes tens of seconds on a busy machine
def test_pool_replaces_idle_deaths_then_disables(tmp_path: Path) -> None:
    script = _script(tmp_path, "print('never runs')\n")
    said: list[str] = []
    pool = SparePool(str(script), _env(), 1, say=said.append, max_idle_deaths=3)
    try:
        pool.start()
        killed: list[int] = []
        for _ in range(3):  # each time, the spare the pool started after the last kill (a fresh Python: seconds
            # under load, 5.0 s once was not enough); 90 s only guards against a hang
            try:
                fresh = wait_for(lambda: sorted(set(pool.idle_pids) - set(killed)), 90, "the pool's next idle spare")
            except AssertionError as exc:  # seen once in a full suite (not reproduced): say what the pool did
                raise AssertionError(f"{exc}; killed {killed}, idle {pool.idle_pids}, the pool said {said}") from None
            pid = fresh[0]
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: pool.disabled, 60, f"the pool to give up on hot spares: {said}")
        assert pool.take() is None
    finally:
        pool.close()
    assert sum("was killed by signal SIGKILL; starting another" in m for m in said) == 2, said
    disabled = [m for m in said if m.startswith("hot spares disabled: ")]
    assert len(disabled) == 1 and "3 died in a row" in disabled[0] and "fresh process" in disabled[0]
    assert not _spare_pids(script)


# --- the agent -------------------------------------------------------------------------------

DRIVER = """
import json, sys
from pathlib import Path
from trainguard.launch.agent import LaunchSpec, Supervisor
kw = json.loads(sys.argv[1])
sched = kw.pop("scheduler_cmd")
kw["script_args"] = tuple(kw.get("script_args", ()))
kw["recovery_path"] = Path(kw["recovery_path"])
sys.exit(Supervisor(LaunchSpec(**kw), scheduler_cmd=sched).run())
"""
SLEEPY_SCHEDULER = "import time; print('scheduler up', flush=True); time.sleep(60)"


def _agent(tmp_path: Path, script: Path, *, merge: bool = False, **kw: object) -> subprocess.Popen:
    spec = {"script": str(script), "nproc_per_node": 2, "sched_port": 1, "max_restarts": 2, "hot_spares": 1,
            "recovery_path": str(tmp_path / "rec"), "sched_exit_wait_s": 0.2, "grace_s": 5.0,
            "scheduler_cmd": [sys.executable, "-c", SLEEPY_SCHEDULER], **kw}
    return subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(spec)], cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge else subprocess.PIPE,
                            text=True)


@pytest.mark.timeout(120)  # against hangs only: a spare imports torch, which takes tens of seconds on a busy machine
def test_supervisor_restarts_a_worker_from_a_hot_spare(tmp_path: Path) -> None:
    script = _script(tmp_path, f"""
        import os, pathlib, signal, sys, time
        node = os.environ["TG_NODE_ID"]
        print("up", node, os.environ["TG_LOCAL_RANK"], os.environ["LOCAL_RANK"], sys.argv[1:], __name__, flush=True)
        mark = pathlib.Path({str(tmp_path)!r}, "died-" + node)
        if node == "1" and not mark.exists():
            mark.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.5)
        print("done", node, flush=True)
    """)
    proc = _agent(tmp_path, script, script_args=["--lr", "0.1"])
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0, err
    assert "1 hot spare;" in err
    assert "[agent] worker 1 (pid " in err and "was killed by signal SIGKILL" in err
    assert "[agent] restarting worker 1 from a hot spare (restart 1/2)" in err
    assert out.count("[worker 1] up 1 1 1 ['--lr', '0.1'] __main__") == 2  # the first one and the spare
    assert out.count("[worker 1] done 1") == 1 and out.count("[worker 0] done 0") == 1
    assert not _spare_pids(script)  # no spare outlives the agent


# --- configuration ------------------------------------------------------------------------------


@pytest.mark.timeout(5)
def test_hot_spares_flag_and_env(tmp_path: Path) -> None:
    script = _script(tmp_path, "pass\n")
    parse = cli.build_parser().parse_args
    env = {"TG_RECOVERY_PATH": str(tmp_path / "rec")}
    assert cli.resolve_run(parse(["run", str(script)]), env).hot_spares == 1
    assert cli.resolve_run(parse(["run", "--max-restarts", "0", str(script)]), env).hot_spares == 0
    assert cli.resolve_run(parse(["run", "--hot-spares", "0", str(script)]), env).hot_spares == 0
    assert cli.resolve_run(parse(["run", "--hot-spares", "2", str(script)]), env).hot_spares == 2
    assert cli.main(["run", "--hot-spares", "-1", str(script)]) == 2
    spec = LaunchSpec(script="x.py", nproc_per_node=2, sched_port=9, recovery_path=Path("/r"), hot_spares=1)
    env = spare_env({"TG_NODE_ID": "4", "MS_NODE_ID": "4", "LOCAL_RANK": "1", "TG_LOCAL_RANK": "1"}, spec)
    assert not {"TG_NODE_ID", "MS_NODE_ID", "TG_LOCAL_RANK", "LOCAL_RANK"} & set(env)
    assert env["TG_ROLE"] == "worker" and env["OMP_NUM_THREADS"] == "1" and env["TG_WORKER_NUM"] == "2"
