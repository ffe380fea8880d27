"""The MindSpore disaster-recovery flow (reference 000) with real processes and the real scripts.

`examples/run.sh` starts 2 workers and a scheduler in the background, MindSpore style (MS_* names,
MS_ENABLE_RECOVERY=1, MS_RECOVERY_PATH=./recovery/). One process is killed with SIGKILL in the
middle of training and brought back by `examples/recover.sh`; every process must then end with
exit code 0 and both workers must print their test accuracy.

run.sh exits at once and leaves its processes to the init process, so this test makes itself a
child subreaper (Linux prctl) for the duration: the orphans become its children and their real
exit codes can be collected with waitpid.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import free_port

REPO = Path(__file__).resolve().parents[1]
RUN_SH = REPO / "examples" / "run.sh"
RECOVER_SH = REPO / "examples" / "recover.sh"
PR_SET_CHILD_SUBREAPER = 36
BUDGET_S = 150.0  # against hangs only: the whole scenario, start to last exit (over 55 s on a busy machine)
# 3 epochs of ~90 steps per rank (batch 8): about 4 s of training, long enough to kill mid-run
ARGS = "--epochs 3 --batch-size 8"
CLUSTER_VARS = ("TG_", "MS_", "OMPI_", "PMI", "TORCHELASTIC_", "SLURM_")
TORCHRUN_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs bash and Linux prctl")


def script_env(port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_VARS) and k not in TORCHRUN_VARS}
    bindir = str(Path(sys.executable).parent)
    env.update(PATH=bindir + os.pathsep + env.get("PATH", ""), PYTHON=sys.executable, WORKERS="2",
               SCHED_PORT=str(port), ARGS=ARGS, TG_HEARTBEAT_TIMEOUT="3")
    return env


@contextlib.contextmanager
def subreaper():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.skip(f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(ctypes.get_errno())}")
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


class Job:
    """One run.sh job in `cwd`: its processes, their logs, and their exit codes."""

    def __init__(self, cwd: Path, port: int):
        self.cwd, self.env = cwd, script_env(port)
        self.deadline = time.monotonic() + BUDGET_S
        self.live: dict[int, str] = {}  # pid -> name, not yet reaped
        self.codes: dict[str, list[int]] = {}  # name -> exit codes, in order

    def log(self, name: str) -> str:
        path = self.cwd / "device" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"--- {n}.log ---\n{self.log(n)}" for n in ("scheduler", "worker_0", "worker_1"))

    def _script(self, *argv: str) -> None:
        proc = subprocess.run(["bash", *argv], cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=20)
        assert proc.returncode == 0, f"{argv} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"

    def _adopt(self, name: str) -> int:
        pid = int((self.cwd / "device" / f"{name}.pid").read_text())
        self.live[pid] = name
        return pid

    def start(self) -> None:
        self._script(str(RUN_SH))
        for name in ("worker_0", "worker_1", "scheduler"):
            self._adopt(name)

    def recover(self, *argv: str) -> int:
        self._script(str(RECOVER_SH), *argv)
        return self._adopt("scheduler" if argv[0] == "scheduler" else f"worker_{argv[1]}")

    def wait_for_log(self, name: str, text: str) -> None:
        while text not in self.log(name):
            self._reap()
            if time.monotonic() > self.deadline:
                pytest.fail(f"no {text!r} in {name}.log within {BUDGET_S:.0f} s\n{self.logs()}")
            time.sleep(0.02)

    def pid_of(self, name: str) -> int:
        return next(pid for pid, n in self.live.items() if n == name)

    def kill(self, name: str) -> None:
        pid = self.pid_of(name)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        self._record(pid, status)

    def _record(self, pid: int, status: int) -> None:
        self.codes.setdefault(self.live.pop(pid), []).append(os.waitstatus_to_exitcode(status))

    def _reap(self) -> None:
        for pid in list(self.live):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                self._record(pid, status)

    def wait_all(self) -> None:
        while self.live:
            self._reap()
            if time.monotonic() > self.deadline:
                still = ", ".join(sorted(self.live.values()))
                pytest.fail(f"still running after {BUDGET_S:.0f} s: {still}\n{self.logs()}")
            time.sleep(0.05)

    def cleanup(self) -> None:
        for pid in list(self.live):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.live.clear()


@pytest.fixture
def job(tmp_path: Path):
    with subreaper():
        j = Job(tmp_path, free_port())
        try:
            yield j
        finally:
            j.cleanup()


def assert_all_finished(job: Job, *killed: str) -> None:
    for name in killed:
        assert job.codes[name][0] == -signal.SIGKILL
    final = {name: codes[-1] for name, codes in job.codes.items()}
    assert final == {"worker_0": 0, "worker_1": 0, "scheduler": 0}, f"exit codes {job.codes}\n{job.logs()}"
    for rank in (0, 1):
        assert f"rank {rank}: test accuracy" in job.log(f"worker_{rank}"), job.logs()


@pytest.mark.timeout(200)
def test_worker_then_scheduler_killed_and_each_recovered_by_script(job: Job) -> None:
    """One job, two faults: worker 1 is killed in epoch 1 and brought back by recover.sh; in epoch 2 the
    scheduler is killed and brought back by recover.sh. Every process ends with 0."""
    job.start()
    job.wait_for_log("worker_1", "epoch: 1 step:")
    job.kill("worker_1")
    assert "test accuracy" not in job.log("worker_1"), "worker 1 finished before it could be killed"
    job.recover("worker", "1")
    job.wait_for_log("worker_1", "epoch: 2 step:")
    job.kill("scheduler")
    assert "all 2 workers finished" not in job.log("scheduler"), "the job ended before the scheduler was killed"
    job.recover("scheduler")
    job.wait_all()
    assert_all_finished(job, "worker_1", "scheduler")
    assert "resumed at step" in job.log("worker_0"), job.logs()  # the survivor regrouped without restarting
    assert job.log("worker_1").startswith("epoch: 1 step: 20,")  # the replacement appended to the same log
    assert (job.cwd / "recovery" / "cluster.db").exists() and (job.cwd / "ckpt_of_rank").is_dir()
    assert "resumed" in job.log("scheduler"), job.logs()  # the new scheduler reloaded ./recovery/cluster.db
    assert "scheduler started" in job.log("scheduler")  # appended to the first one's log
