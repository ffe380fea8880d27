"""The same unchanged script under every launcher users already have: torchrun, mpirun, and by hand.

examples/allgather.py gathers each rank's id; every rank must print [[0.0], [1.0]].
Under torchrun and mpirun rank 0 starts the scheduler as a child process and restarts it if it
dies. Under torchrun it binds port 0 and rank 0 publishes the port through torchrun's own store;
mpirun uses TG_SCHED_PORT (default 8118).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import FAST, JOB, assert_identical, finals, free_port, wait_for

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "examples" / "allgather.py")
GATHER = "[[0.],[1.]]"
CLUSTER_VARS = ("TG_", "MS_", "OMPI_", "PMI", "PMIX_", "TORCHELASTIC_", "SLURM_")
TORCHRUN_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT"}


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_VARS) and k not in TORCHRUN_VARS}
    bindir = str(Path(sys.executable).parent)
    env.update(PATH=bindir + os.pathsep + env.get("PATH", ""), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TG_CONNECT_TIMEOUT="30", TG_JOIN_TIMEOUT="30")
    env.update(extra)
    return env


def gathered_lines(out: str) -> list[str]:
    """The printed gathers; ranks that share one stdout may interleave a print and its newline."""
    return re.findall(r"\[\[.*?\]\]", out)


def torchrun_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "torchrun"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


@pytest.mark.timeout(90)
def test_torchrun_standalone() -> None:
    proc = subprocess.run([*torchrun_cmd(), "--standalone", "--nproc-per-node", "2", SCRIPT], env=clean_env(),
                          capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert gathered_lines(proc.stdout) == [GATHER, GATHER], proc.stdout + proc.stderr


@pytest.mark.timeout(90)
def test_torchrun_static_rendezvous() -> None:
    """torchrun's default (static) rendezvous on a chosen master port."""
    cmd = [*torchrun_cmd(), "--nnodes", "1", "--nproc-per-node", "2", "--master-port", str(free_port()), SCRIPT]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert gathered_lines(proc.stdout) == [GATHER, GATHER], proc.stdout + proc.stderr


@pytest.mark.timeout(90)
def test_torchrun_style_env_without_agent_store() -> None:
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set by hand (no torchrun agent): rank 0 must host the
    store that publishes the scheduler's port, and keep it alive until the others have read it."""
    base = clean_env(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, SCRIPT], env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (1, 0)]
    try:
        outs = [p.communicate(timeout=80)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
        assert gathered_lines(out) == [GATHER], out


@pytest.mark.timeout(90)
def test_mpirun() -> None:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun is not on PATH (install OpenMPI, e.g. `apt-get install -y openmpi-bin`)")
    env = clean_env(TG_SCHED_PORT=str(free_port()))
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2", "-x", "TG_SCHED_PORT", "-x", "PATH",
           sys.executable, SCRIPT]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert gathered_lines(proc.stdout) == [GATHER, GATHER], proc.stdout + proc.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize("names", ["TG", "MS"])
def test_hand_launch_scheduler_started_last(names: str) -> None:
    """Workers started first wait for the scheduler; TG_* and MindSpore's MS_* names both work."""
    port = str(free_port())
    if names == "TG":
        common = dict(TG_SCHED_HOST="127.0.0.1", TG_SCHED_PORT=port, TG_WORKER_NUM="2")
        worker = lambda i: dict(TG_ROLE="worker", TG_NODE_ID=str(i))  # noqa: E731
        sched = dict(TG_ROLE="scheduler")
    else:
        common = dict(MS_SCHED_HOST="127.0.0.1", MS_SCHED_PORT=port, MS_WORKER_NUM="2")
        worker = lambda i: dict(MS_ROLE="MS_WORKER", MS_NODE_ID=str(i))  # noqa: E731
        sched = dict(MS_ROLE="MS_SCHED")
    procs = {f"worker {i}": subprocess.Popen([sys.executable, SCRIPT], env=clean_env(**common, **worker(i)),
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in (0, 1)}
    try:
        time.sleep(1.0)
        assert all(p.poll() is None for p in procs.values()), "a worker gave up before the scheduler started"
        procs["scheduler"] = subprocess.Popen([sys.executable, SCRIPT], env=clean_env(**common, **sched),
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        outs = {name: p.communicate(timeout=80)[0] for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
    for name, p in procs.items():
        assert p.returncode == 0, f"{name}: {outs[name]}"
    for i in (0, 1):
        assert gathered_lines(outs[f"worker {i}"]) == [GATHER], outs[f"worker {i}"]
    assert gathered_lines(outs["scheduler"]) == [], outs["scheduler"]


# --- the scheduler child of rank 0 ---------------------------------------------------------------


def proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name: [state, ppid, ...] (psutil is not installed); None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None


def torchrun_job(out: Path, step_sleep: float = 0.2) -> tuple[list[str], dict[str, str]]:
    """`step_sleep` paces the steps (results unchanged) so that a kill lands mid-run; a reference run needs none."""
    cmd = [*torchrun_cmd(), "--standalone", "--nproc-per-node", "2", str(JOB), "--out", str(out / "final"),
           "--epochs", "2", "--step-sleep", str(step_sleep)]
    return cmd, clean_env(**FAST, TG_ENABLE_RECOVERY="1", TG_RECOVERY_PATH=str(out / "recovery"))


def events(out: Path) -> list[dict]:
    """The event log so far; a line being written is left for the next look."""
    path = out / "recovery" / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return found


def training_for(out: Path, seconds: float) -> bool:
    """Both ranks have trained for `seconds` (since their restore at step 0), or are past step 4."""
    found = events(out)
    if any(e["event"] == "step_finished" and e.get("step", 0) >= 4 for e in found):
        return True
    starts = [e["ts"] for e in found if e["event"] == "restored"]
    return len(starts) >= 2 and time.time() > max(starts) + seconds


def scheduler_starts(out: Path) -> list[dict]:
    return [e for e in events(out) if e["event"] == "scheduler_started"]


@pytest.mark.timeout(240)
def test_torchrun_scheduler_child_killed_mid_run_is_restarted_bit_identically(tmp_path: Path) -> None:
    """The scheduler is a child process of rank 0; kill -9 of it mid-run: rank 0 restarts it on the same
    port, it reloads cluster.db, the workers reconnect, and the final states equal an uninterrupted run's."""
    base, hit = tmp_path / "base", tmp_path / "kill"
    cmd, env = torchrun_job(base, step_sleep=0)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [started] = scheduler_starts(base)
    assert proc_stat(started["pid"]) is None, "the scheduler must end with the job"

    cmd, env = torchrun_job(hit)
    log = open(tmp_path / "kill.log", "w")
    job = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: training_for(hit, 1.0), 60, "1 s of training")
        [first] = scheduler_starts(hit)
        pid, port = first["pid"], first["port"]
        stat = proc_stat(pid)
        assert stat is not None and stat[0] != "Z", "the scheduler is not running"
        rank0 = Path(f"/proc/{stat[1]}/cmdline").read_bytes().split(b"\0")
        assert str(JOB).encode() in rank0, f"the scheduler's parent is not a worker: {rank0}"
        assert not any(e["event"] == "finished" for e in events(hit)), "the kill must land mid-run"
        os.kill(pid, signal.SIGKILL)
        restarted = wait_for(lambda: scheduler_starts(hit)[1:], 30, "the restarted scheduler")[0]
        assert job.wait(120) == 0, (tmp_path / "kill.log").read_text()
    finally:
        job.kill()
        job.wait(10)
        log.close()
    text = (tmp_path / "kill.log").read_text()
    assert restarted["resumed"] and restarted["port"] == port and restarted["pid"] != pid, restarted
    assert f"the scheduler (pid {pid}) was killed by signal SIGKILL" in text and "restart 1/3 within 3600 s" in text, text
    assert proc_stat(restarted["pid"]) is None, "the restarted scheduler must end with the job"
    assert sum(e["event"] == "finished" for e in events(hit)) == 2
    for r, (a, b) in enumerate(zip(finals(base, 2), finals(hit, 2))):
        assert_identical(a, b, f"rank {r}")


@pytest.mark.parametrize("command", ["run", "verify"])
def test_the_scripts_own_options_after_it_are_the_scripts_as_under_torchrun(command) -> None:
    """A blind SimCLR port's `--sched cosine` ended `trainguard run` with "ambiguous option: --sched could match
    --sched-host, --sched-port" (exit 2); torchrun passes it on. Whatever follows the script is the script's, an
    option trainguard also has (`--workers`) too."""
    from trainguard.launch.cli import build_parser

    args = build_parser().parse_args([command, "--workers", "3", "train.py", "--sched", "cosine", "--workers", "9"])
    assert (args.script, args.script_args, args.workers) == ("train.py", ["--sched", "cosine", "--workers", "9"], 3)
