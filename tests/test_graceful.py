"""Graceful exit and recover strategies with real processes; every resumed run must end bit-identical
to a run that never stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from harness import assert_identical, env, events, finals, job_args, launch, wait_for

from trainguard.checkpoint import list_checkpoints
from trainguard.exitcodes import EXIT_PREEMPTED

pytestmark = pytest.mark.timeout(120)

CKPT = ("--save-steps", "4", "--dying-gasp")


@pytest.fixture
def baseline(baseline_runs):
    return baseline_runs(2)


def run_cmd(out: Path, *flags: str, extra: tuple = ()) -> list[str]:
    """The same command as harness.launch, for runs the test signals itself."""
    return [sys.executable, "-m", "trainguard", "run", "--workers", "2", "--recovery-path", str(out / "recovery"),
            "--hot-spares", "0", *flags, *job_args(out, extra=extra)]  # a graceful stop replaces nobody


def ckpt_args(out: Path, how: str = "config", *more: str) -> tuple:
    return ("--ckpt", str(out / "ckpt"), *CKPT, how, *more)


def complete_steps(out: Path, rank: int) -> list[int]:
    """Complete checkpoints in the shared folder (each holds every rank's file; `rank` is kept for reading)."""
    return [c.step for c in list_checkpoints(out / "ckpt", "job")]


def check_final(out: Path, baseline, proc=None) -> None:
    if proc is not None:
        assert proc.returncode == 0, proc.stderr[-4000:]
    got = finals(out, 2)
    for rank in range(2):
        assert_identical(got[rank], baseline[rank], f"rank {rank}")


def restored_from_disk(out: Path) -> set[int]:
    return {e["step"] for e in events(out) if e["event"] == "restored" and e["source"] == "disk"}


def graceful_steps(out: Path) -> dict[int, int]:
    return {e["rank"]: e["step"] for e in events(out) if e["event"] == "graceful_exit"}


# --- graceful exit ------------------------------------------------------------------------


def sigterm_after_step_4(out: Path, targets, *flags: str) -> tuple[subprocess.Popen, str, tuple]:
    """Run the job (a checkpoint every 4 steps, a dying gasp), SIGTERM `targets(launcher pid)` once step 4's
    checkpoint is complete, and wait for the end: (the launcher, its stderr, the job's extra args)."""
    extra = ckpt_args(out, "callback", "--step-sleep", "0.1")
    proc = subprocess.Popen(run_cmd(out, *flags, extra=extra), env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: 4 in complete_steps(out, 1), 60, "the checkpoint of step 4")
        for pid in targets(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, err, extra


def test_sigterm_to_the_launcher_saves_and_the_same_command_resumes(tmp_path, baseline):
    proc, err, extra = sigterm_after_step_4(tmp_path, lambda launcher: [launcher])
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    stopped = graceful_steps(tmp_path)
    assert set(stopped) == {0, 1} and len(set(stopped.values())) == 1  # every rank stopped at the same step
    (step,) = set(stopped.values())
    assert 4 <= step < 32 and all(step in complete_steps(tmp_path, r) for r in range(2))
    assert "stopped on SIGTERM" in err and "restarting" not in err

    again = launch(tmp_path, 2, extra=extra)  # the same command again
    check_final(tmp_path, baseline, again)
    assert step in restored_from_disk(tmp_path)
    assert (tmp_path / "ckpt" / "strategy.json").is_file() and (tmp_path / "recovery" / "strategy.json").is_file()


def _tree(root: int) -> list[int]:
    """`root` and every process descended from it (workers run in sessions of their own: ppid, not pgid)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += parents.get(pid, [])
    return found


def test_sigterm_to_every_process_of_the_job_at_once_is_one_graceful_stop(tmp_path):
    """Slurm's scancel (proctrack/linuxproc, cgroup), systemd's stop and `kill 0` signal every process of the
    job, the zygote, the scheduler and a hot spare included: still one dying gasp at one step, exit 75."""
    signalled: list[int] = []

    def everyone(launcher: int) -> list[int]:
        signalled.extend(_tree(launcher))
        return signalled

    proc, err, _ = sigterm_after_step_4(tmp_path, everyone, "--hot-spares", "1")
    assert len(signalled) >= 6, signalled  # agent, scheduler, zygote, 2 workers, the spare
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    stopped = graceful_steps(tmp_path)
    assert set(stopped) == {0, 1} and len(set(stopped.values())) == 1, err[-3000:]
    (step,) = set(stopped.values())
    assert step in complete_steps(tmp_path, 0) and "zygote" not in err.split("received SIGTERM", 1)[1], err[-3000:]


def test_sigterm_straight_to_one_worker_stops_the_whole_job(tmp_path, baseline):
    extra = ckpt_args(tmp_path)
    proc = launch(tmp_path, 2, faults="1:5:term", extra=extra)  # rank 1 SIGTERMs itself after step 5
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr[-3000:]
    assert graceful_steps(tmp_path) == {0: 6, 1: 6}  # rank 0 learns it at the next commit point
    assert [complete_steps(tmp_path, r) for r in range(2)] == [[4, 6], [4, 6]]
    assert "restarting" not in proc.stderr
    state = [e for e in events(tmp_path) if e["event"] == "job_end"][-1]["state"]
    assert state == "stopped"

    again = launch(tmp_path, 2, extra=extra)
    check_final(tmp_path, baseline, again)
    assert 6 in restored_from_disk(tmp_path)
    assert "trainguard: resumed at step 6 (epoch 0, batch 6) from the checkpoint on disk" in again.stdout

    done = launch(tmp_path, 2, extra=extra)  # a rerun of a finished job says so, and trains nothing
    check_final(tmp_path, baseline, done)
    assert "the training is already complete at step 32" in done.stdout


def test_sigterm_without_a_dying_gasp_checkpoint_says_a_rerun_starts_over(tmp_path):
    proc = launch(tmp_path, 2, faults="1:5:term")
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr[-3000:]
    assert "nothing was saved, so running the same command again starts over" in proc.stderr
    assert "run the same command again to resume" not in proc.stderr


def test_a_save_the_grace_period_cannot_hold_is_never_complete(tmp_path, baseline):
    extra = ckpt_args(tmp_path)
    cmd = run_cmd(tmp_path, "--grace-period", "1.5", extra=extra)
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env(TG_FAULT="1:5:term", TG_FAULT_SLOW_SAVE="20"), capture_output=True,
                          text=True, timeout=90)
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr[-3000:]
    assert time.monotonic() - started < 60
    assert "did not finish within the grace period (1.5 s" in proc.stderr
    for rank in range(2):
        assert complete_steps(tmp_path, rank) == [4]  # step 6 was cut: it does not look complete
    leftovers = list((tmp_path / "ckpt").glob(".job-1_6.tmp-*"))
    assert leftovers, "the cut save should have left its temp folder (files written, no manifest)"

    again = launch(tmp_path, 2, extra=extra)
    check_final(tmp_path, baseline, again)
    assert restored_from_disk(tmp_path) == {4}


# --- strategies -------------------------------------------------------------------------------


def test_retry_redoes_failed_steps_in_the_same_processes(tmp_path, baseline):
    """A collective that fails on rank 1 in step 6, and a Retriable raised on rank 0 in step 10."""
    cmd = run_cmd(tmp_path, "--recover-strategy", "retry", extra=("--retriable-at", "0:9"))
    proc = subprocess.run(cmd, env=env(TG_FAULT="1:5:collective"), capture_output=True, text=True, timeout=90)
    check_final(tmp_path, baseline, proc)
    ev = events(tmp_path)
    assert len([e for e in ev if e["event"] == "registered"]) == 2  # no process was restarted
    assert "restarting" not in proc.stderr
    restores = [e["to_step"] for e in ev if e["event"] == "restore_step" and not e.get("fresh")]
    assert restores == [5, 9]


def test_exit_stops_the_job_at_the_first_fault_and_names_the_root_cause(tmp_path):
    cmd = run_cmd(tmp_path, "--recover-strategy", "exit", "--grace-period", "30")
    proc = subprocess.run(cmd, env=env(TG_FAULT="1:6:kill"), capture_output=True, text=True, timeout=90)
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    summary = err[err.index("trainguard: worker 1 (pid "):]
    assert "was killed by signal SIGKILL" in summary.splitlines()[0]
    assert "recover strategy is exit" in err and "restarting" not in err
    assert "[worker 0] trainguard: rank 0: stopping (recover strategy exit): step 6" in err
    ev = events(tmp_path)
    killed = next(e["ts"] for e in ev if e["event"] == "fault_injected")
    (left,) = [e for e in ev if e["event"] == "stopped_on_fault"]
    assert left["rank"] == 0 and left["ts"] - killed < 5  # it left by itself, long before the grace's SIGKILL
    assert not (tmp_path / "final").exists()


def test_dump_saves_the_survivors_and_the_dead_ranks_state_then_the_rerun_resumes(tmp_path, baseline):
    extra = ckpt_args(tmp_path)
    cmd = run_cmd(tmp_path, "--recover-strategy", "dump", extra=extra)
    proc = subprocess.run(cmd, env=env(TG_FAULT="1:6:kill"), capture_output=True, text=True, timeout=90)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # rank 0 survived at step 6 (rank 1 died after committing it); every rank's part of a data-parallel
    # state is the same, so rank 0 writes rank 1's part too
    assert "rank 1 died; its state at step 6 is written from the replicas held by rank 0" in proc.stderr
    for rank in range(2):
        assert 6 in complete_steps(tmp_path, rank)

    again = launch(tmp_path, 2, extra=extra)  # the default strategy now
    check_final(tmp_path, baseline, again)
    assert 6 in restored_from_disk(tmp_path)


def test_max_restarts_is_counted_across_the_job_and_the_end_is_clean(tmp_path):
    proc = launch(tmp_path, 2, faults="1:4:kill,1:10:kill:2", max_restarts=1)
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    assert "[agent] restarting worker 1 from a hot spare (restart 1/1)" in err
    summary = err[err.index("trainguard: giving up"):]
    first, *rest = summary.splitlines()
    assert first.startswith("trainguard: giving up after 1 restart; root cause: worker 1 (pid ")
    assert "max restarts: 1 of 1 used" in summary and "last failure: worker 1 (pid " in summary
    # the survivor learns from the scheduler that the job failed and leaves by itself, not by the grace's SIGKILL
    assert "[worker 0] trainguard: rank 0: stopping (recover strategy recover-in-place): joining the cluster failed: " \
           "the job is failed" in err
    ev = events(tmp_path)
    killed = [e["ts"] for e in ev if e["event"] == "fault_injected"][-1]
    (left,) = [e["ts"] for e in ev if e["event"] == "stopped_on_fault"]
    assert left - killed < 5  # well under the 10 s grace period


def test_chaos_sends_sigusr1_to_one_worker_and_the_job_stops_gracefully(tmp_path):
    from trainguard.launch.cli import pick_free_port

    port = pick_free_port("127.0.0.1")
    extra = ckpt_args(tmp_path, "config", "--step-sleep", "0.1")
    # 50 epochs (800 steps, over 80 s): the job cannot end before the signal on a busy machine (the chaos
    # commands below start three Python processes); it stops at the commit after it
    cmd = run_cmd(tmp_path, "--sched-port", str(port), extra=extra)
    cmd[cmd.index("--epochs") + 1] = "50"
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: 4 in complete_steps(tmp_path, 0), 60, "the checkpoint of step 4")
        chaos = [sys.executable, "-m", "trainguard", "chaos", "--sched-port", str(port)]
        stranger = subprocess.run([*chaos, "usr1", "--rank", "1"], capture_output=True, text=True, timeout=30,
                                  env={k: v for k, v in os.environ.items() if not k.startswith("TG_JOB_SECRET")})
        assert stranger.returncode == 2 and "requires the job secret" in stranger.stderr, stranger.stderr
        secret = {**os.environ, "TG_JOB_SECRET_FILE": str(tmp_path / "recovery" / "job.secret")}
        missing = subprocess.run([*chaos, "term", "--rank", "5"], capture_output=True, text=True, timeout=30,
                                 env=secret)
        assert missing.returncode == 2 and "no live worker has rank 5 (live ranks: [0, 1]" in missing.stderr
        hit = subprocess.run([*chaos, "usr1", "--rank", "1"], capture_output=True, text=True, timeout=30, env=secret)
        assert hit.returncode == 0 and "sent SIGUSR1 to rank 1" in hit.stderr
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "[worker 1] trainguard: rank 1: SIGUSR1: stopped at step" in err
    (stopped,) = set(graceful_steps(tmp_path).values())
    assert 4 <= stopped < 800


def test_hand_loop_save_cut_by_the_grace_period_never_looks_complete(tmp_path):
    """tg.GracefulStop (a loop without Session): a dying-gasp save still running at the deadline
    is abandoned, its manifest never written; every rank agreed on the same stop step."""
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, time
        from pathlib import Path
        import torch
        import trainguard as tg

        tg.init()
        rank = tg.get_rank()
        stop = tg.GracefulStop()
        ckpt = Path({str(tmp_path / "ckpt")!r})

        def save(step):  # stands for a save too big for the grace period
            folder = ckpt / f"loop-1_{{step}}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"rank_{{rank}}.bin").write_bytes(b"x" * 1000)
            time.sleep(30)
            (folder / "manifest.json").write_text("{{}}")

        for step in range(1, 1000):
            torch.distributed.all_reduce(torch.ones(1))
            if step == 3 and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # straight to one worker
            if stop.requested(step):
                print(f"rank {{rank}} stops at step {{step}}", flush=True)
                stop.exit(step, lambda: save(step))
            time.sleep(0.01)
    """))
    proc = subprocess.run([sys.executable, "-m", "trainguard", "run", "--workers", "2", "--hot-spares", "0",
                           "--grace-period", "2", str(script)], env=env(), capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == EXIT_PREEMPTED, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "rank 0 stops at step 3" in proc.stdout and "rank 1 stops at step 3" in proc.stdout
    assert "did not finish within the grace period (2 s); it is left incomplete" in proc.stdout + proc.stderr
    assert "stopping the scheduler" not in proc.stdout + proc.stderr  # each said goodbye: the job ended at once
    folder = tmp_path / "ckpt" / "loop-1_3"
    assert sorted(p.name for p in folder.iterdir()) == ["rank_0.bin", "rank_1.bin"]  # no manifest


SIGNALLED_SCRIPT = """
import os, signal, sys
import torch
import trainguard as tg
from torch.utils.data import TensorDataset
from trainguard import DDP, DataLoader, DistributedSampler

when = sys.argv[1]  # "before": rank 1 signals itself before its loop; "after": every rank, after its loop
tg.init()
rank = tg.get_rank()
if when == "before" and rank == 1:
    os.kill(os.getpid(), signal.SIGUSR1)  # while the script starts: held, not the default action (death)
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
optimizer = tg.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data))
for epoch in range(tg.start_epoch(0), 2):
    loader.sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
if when == "after":
    os.kill(os.getpid(), signal.SIGTERM)  # the training is complete: noted, and the script goes on
print(f"rank {rank} reached the end of the script", flush=True)
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_stop_signal_outside_the_training_loop_never_kills_a_worker(tmp_path, when):
    """Before the loop (while the script starts) the signal is held and the job stops at the first commit,
    every rank at the same step; after the loop it is noted and the script ends as it would. Neither is the
    signal's default action, which the launcher took for a crash and restarted (issue: a SIGUSR1 that came
    after the loop on a busy machine)."""
    script = tmp_path / "signalled.py"
    script.write_text(SIGNALLED_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "trainguard", "run", "--workers", "2", "--recovery-path",
                           str(tmp_path / "recovery"), "--hot-spares", "0", str(script), when],
                          env=env(), capture_output=True, text=True, timeout=120)
    err = proc.stdout + proc.stderr
    registered = [e for e in events(tmp_path) if e["event"] == "registered"]
    assert [e["incarnation"] for e in registered] == [1, 1], err[-3000:]  # nobody was restarted
    if when == "after":
        assert proc.returncode == 0, err[-3000:]
        assert err.count("reached the end of the script") == 2
    else:
        assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
        assert "[worker 1] trainguard: SIGUSR1 received outside the training loop: held" in err
        assert "reached the end of the script" not in err
        (stopped,) = set(graceful_steps(tmp_path).values())  # at the first commit point, on both ranks
        assert stopped <= 1 and len(graceful_steps(tmp_path)) == 2
