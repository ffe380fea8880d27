"""Running real trainguard jobs in tests and comparing their final states bit for bit."""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import trainguard as tg

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "jobs" / "dp_job.py"
# the product's default heartbeat timeout (5 s): with 2 s, a worker whose heartbeat thread waited over 2 s for
# the GIL (torch's C code holds it in places) on a 2-core machine busy with other work was declared hung and
# killed, in a run without a fault (issue "A test suite that holds under load")
FAST = {"TG_HEARTBEAT_INTERVAL": "0.2", "TG_HEARTBEAT_TIMEOUT": "5", "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1", "TG_FAULT": "",
        "TG_EXACT": "strict"}  # every test job runs under the replay audit's strict mode: a false alarm fails it


RESTARTING_FAULTS = ("kill", "stop", "raise", "collective")  # TG_FAULT kinds after which a worker may be replaced


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, **FAST, **extra}


def job_args(out: Path, *, level: str = "low", epochs: int = 2, extra: tuple = ()) -> list[str]:
    return [str(JOB), "--out", str(out / "final"), "--level", level, "--epochs", str(epochs), *extra]


def launch(out: Path, workers: int, *, faults: str = "", level: str = "low", epochs: int = 2, extra: tuple = (),
           max_restarts: int = 3, timeout: float = 150, spares: int | None = None,
           extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", str(workers), "--max-restarts", str(max_restarts),
           "--recovery-path", str(out / "recovery")]
    if spares is None and not any(f in faults for f in RESTARTING_FAULTS):
        spares = 0  # nothing will be replaced: a warm spare would only take CPU from the workers' start
    if spares is not None:
        cmd += ["--hot-spares", str(spares)]
    cmd += job_args(out, level=level, epochs=epochs, extra=extra)
    proc = subprocess.run(cmd, env=env(TG_FAULT=faults, **(extra_env or {})), capture_output=True, text=True, timeout=timeout)
    (out / "launcher.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    return proc


def shared_dir(tmp_path_factory) -> Path:
    """A directory every pytest-xdist worker of this session sees (the session's own base without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock between the processes of this test session (xdist workers)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def baselines(tmp_path_factory):
    """Uninterrupted runs' final states, run once per (workers, level, epochs) in the whole session (the first
    xdist worker to ask runs it, the others wait for it) and cached: the reference a test with faults must
    equal bit for bit."""
    cache: dict[tuple, list[dict]] = {}
    shared = shared_dir(tmp_path_factory)

    def get(workers: int, level: str = "low", epochs: int = 2) -> list[dict]:
        key = (workers, level, epochs)
        if key not in cache:
            out = shared / f"baseline-{workers}-{level}-{epochs}"
            with locked(shared / f"{out.name}.lock"):
                if not (out / "complete").exists():
                    shutil.rmtree(out, ignore_errors=True)
                    out.mkdir()
                    proc = launch(out, workers, level=level, epochs=epochs, max_restarts=0, spares=0)
                    assert proc.returncode == 0, proc.stderr[-3000:]
                    (out / "complete").write_text("")
            cache[key] = finals(out, workers)
        return cache[key]

    return get


def finals(out: Path, world: int) -> list[dict]:
    return [tg.load_state(out / "final" / f"rank_{r}.safetensors") for r in range(world)]


def assert_identical(a, b, where: str = "") -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys differ"
        for k in a:
            assert_identical(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: tensors differ"
    elif hasattr(a, "shape"):  # numpy
        assert (a == b).all(), f"{where}: arrays differ"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def changed_lines(original: Path, port: Path) -> tuple[int, str]:
    """How many lines a port changed from its original (the larger side of each differing run), and the diff."""
    a, b = original.read_text().splitlines(), port.read_text().splitlines()
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    return (sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal"),
            "\n".join(difflib.unified_diff(a, b, lineterm="")))


def verify_identical(tmp_path: Path, script: Path, faults: str, args: list[str], *, steps: int, workers: int,
                     **extra: str) -> subprocess.CompletedProcess:
    """`trainguard verify` of `script` with `faults`, its runs kept in `tmp_path`: every row must be identical."""
    cmd = [sys.executable, "-m", "trainguard", "verify", "--steps", str(steps), "--keep", str(tmp_path), "--workers",
           str(workers), "--faults", faults, str(script), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env(TG_EXACT="", **extra), capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "every run is identical to the one without a fault" in proc.stdout, proc.stdout
    return proc


def rank0_lines(log: Path, pattern: "re.Pattern[str]") -> list[str]:
    """Rank 0's lines matching `pattern`, once each (a pass redone after a fault prints its line again)."""
    return list(dict.fromkeys(line.split("] ", 1)[1] for line in log.read_text().splitlines()
                              if line.startswith("[worker 0] ") and pattern.search(line)))


def events(out: Path) -> list[dict]:
    path = out / "recovery" / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_logged(cmd: list[str], out: Path, job_env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`trainguard run ...` with its output in OUT/stdout.log and OUT/stderr.log. A run still going after `timeout`
    fails the test with what it was doing: every worker's stacks (SIGUSR2, worker/hang.py), the job's recovery
    report, and the launcher's last lines."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "stdout.log", "w") as so, open(out / "stderr.log", "w") as se:
        proc = subprocess.Popen(cmd, cwd=REPO, env=job_env, stdout=so, stderr=se, text=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for e in events(out):
                if e["event"] == "registered":
                    with contextlib.suppress(OSError):
                        os.kill(e["pid"], signal.SIGUSR2)
            time.sleep(2)
            proc.terminate()  # the launcher forwards it to its workers
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            report = subprocess.run([sys.executable, "-m", "trainguard", "report", str(out / "recovery")], cwd=REPO,
                                    env=job_env, capture_output=True, text=True, timeout=60)
            pytest.fail(f"still running after {timeout:g} s:\n{report.stdout}{report.stderr}\n"
                        f"{(out / 'stdout.log').read_text()[-3000:]}\n--- stderr ---\n"
                        f"{(out / 'stderr.log').read_text()[-20000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, (out / "stdout.log").read_text(),
                                       (out / "stderr.log").read_text())


def deaths(ev: list[dict]) -> list[tuple[str, str]]:
    """(node, kind) of every worker the scheduler took for failed. A ``collective`` report is left out: it names
    the survivor that saw a collective fail (it stays alive, only the generation ends), and whether a survivor's
    report or the agent's word on the dead one reaches the scheduler first is a race over the network."""
    return [(e["node"], e["kind"]) for e in ev if e["event"] == "failure_detected" and e.get("kind") != "collective"]


def wait_step(out: Path, step: int, timeout: float = 90) -> None:
    """Until rank 0 has said (its progress events, every 0.5 s) that the job committed `step` steps."""
    wait_for(lambda: any(e["event"] == "progress" and e["step"] >= step for e in events(out)), timeout,
             f"step {step}")


def wait_for(predicate, timeout: float, what: str, period: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class HandJob:
    """A scheduler and N workers started by hand with TG_* env, as a user would in a shell."""

    def __init__(self, out: Path, workers: int, port: int, *, extra: tuple = (), level: str = "low", epochs: int = 2):
        self.out, self.workers, self.port = out, workers, port
        self.args = job_args(out, level=level, epochs=epochs, extra=extra)
        self.procs: dict[str, subprocess.Popen] = {}
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def _env(self, role: str, node: str | None) -> dict[str, str]:
        e = env(TG_ROLE=role, TG_SCHED_HOST="127.0.0.1", TG_SCHED_PORT=str(self.port),
                TG_WORKER_NUM=str(self.workers), TG_ENABLE_RECOVERY="1", TG_RECOVERY_PATH=str(self.out / "recovery"))
        if node is not None:
            e["TG_NODE_ID"] = node
        return e

    def start(self, name: str) -> subprocess.Popen:
        role, node = ("scheduler", None) if name == "sched" else ("worker", name)
        log = open(self.out / "logs" / f"{name}.log", "a")
        proc = subprocess.Popen([sys.executable, "-u", *self.args], env=self._env(role, node), stdout=log,
                                stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start_all(self) -> None:
        self.start("sched")
        for i in range(self.workers):
            self.start(str(i))

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.procs[name].send_signal(sig)
        self.procs[name].wait(10)

    def wait(self, timeout: float = 120) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        return {n: p.wait(max(1, deadline - time.monotonic())) for n, p in self.procs.items()}

    def log(self, name: str) -> str:
        return (self.out / "logs" / f"{name}.log").read_text()

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port picked before its server starts (a scheduler
    started last, a metrics endpoint) is never taken meanwhile by a process of another test binding port 0 or
    connecting out (a loaded run once had a worker meet another test's scheduler on its port)."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()  # the OS's entropy: independent of the tests' seeded streams
    for _ in range(200):
        port = rng.randrange(10_000, max(10_001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every pick was taken: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
