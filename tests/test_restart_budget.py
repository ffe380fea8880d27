"""The restart budget (launch/budget.py): a large total cap (`--max-restarts`, default 32767) and a rate
per worker (`--restart-limit` restarts within `--restart-window` seconds, default 3 per hour) that ends
a crash loop. Pure decisions with a fake clock, the flag / job file / env resolution, and a real crash
loop under `trainguard run`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard.config import Role
from trainguard.errors import ConfigError
from trainguard.launch import cli
from trainguard.launch.budget import DEFAULT_MAX_RESTARTS, RestartRate, restart_rate
from trainguard.launch.jobfile import load_job_file
from trainguard.launch.policy import (
    Action,
    Failure,
    LaunchSpec,
    decide_exit,
    failure_summary,
)
from trainguard.strategies import parse_strategy

REPO = Path(__file__).resolve().parents[1]

# --- the rate (pure) -----------------------------------------------------------------------------


@pytest.mark.timeout(5)
def test_a_crash_loop_is_n_restarts_within_the_window() -> None:
    rate = RestartRate(limit=3, window_s=100.0)
    assert rate.crash_loop([], 0.0) == ""
    assert rate.crash_loop([10.0, 20.0], 25.0) == ""  # 2 of 3
    why = rate.crash_loop([10.0, 20.0, 30.0], 31.0)
    assert why == "crash loop: it failed again after 3 restarts of its own in 21 s (--restart-limit 3 per --restart-window 100 s)"
    assert rate.crash_loop([10.0, 20.0, 30.0], 110.0) == ""  # the first slid out of the window
    assert rate.crash_loop([10.0, 20.0, 30.0, 105.0], 110.0) != ""  # ... and another came in


@pytest.mark.timeout(5)
def test_decide_exit_applies_the_rate_and_the_total_cap() -> None:
    rate = RestartRate(limit=2, window_s=60.0)
    go = decide_exit(Role.WORKER, -9, 5, 100, rate=rate, restarts=[0.0, 50.0], now=70.0)
    assert go.action is Action.RESTART and go.reason == "restart 6/100" and not go.crash_loop
    loop = decide_exit(Role.WORKER, -9, 5, 100, rate=rate, restarts=[40.0, 50.0], now=70.0)
    assert loop.action is Action.GIVE_UP and loop.crash_loop and loop.reason.startswith("crash loop: ")
    assert decide_exit(Role.SCHEDULER, 1, 5, 100, rate=rate, restarts=[40.0, 50.0], now=70.0).crash_loop
    elastic = decide_exit(Role.WORKER, -9, 5, 100, parse_strategy("elastic"), rate=rate, restarts=[40.0, 50.0],
                          now=70.0)
    assert elastic.action is Action.LEFT_OUT and elastic.crash_loop and "goes on without it" in elastic.reason
    capped = decide_exit(Role.WORKER, -9, 3, 3, rate=rate, restarts=[], now=70.0)  # an explicit total cap
    assert capped.action is Action.GIVE_UP and capped.reason == "all 3 restarts are used" and not capped.crash_loop
    assert decide_exit(Role.WORKER, -9, 0, 0, rate=rate).reason == "restarts are off (--max-restarts 0)"
    # the defaults: a large total, 3 per worker within an hour
    assert decide_exit(Role.WORKER, -9, 1000, DEFAULT_MAX_RESTARTS, restarts=[0.0, 4000.0, 8000.0],
                       now=9000.0).action is Action.RESTART
    assert decide_exit(Role.WORKER, -9, 3, DEFAULT_MAX_RESTARTS, restarts=[0.0, 10.0, 20.0],
                       now=30.0).crash_loop


@pytest.mark.timeout(5)
def test_the_final_message_says_crash_loop_and_how_to_change_it() -> None:
    rate = RestartRate(limit=2, window_s=60.0)
    why = rate.crash_loop([1.0, 2.0], 3.0)
    root, last = Failure("worker 0", 100, -9), Failure("worker 0", 300, -9, ("Segmentation fault",))
    text = failure_summary(root, 2, last, DEFAULT_MAX_RESTARTS, crash_loop=why)
    lines = text.splitlines()
    assert lines[0] == ("trainguard: giving up after 2 restarts; root cause: worker 0 (pid 100) was killed by "
                        "signal SIGKILL")
    assert lines[1] == (f"  worker 0: {why}. Fix what makes it fail, or allow more with --restart-limit N / "
                        "--restart-window SECONDS (TG_RESTART_LIMIT / TG_RESTART_WINDOW, or restart_limit: / "
                        "restart_window: in the job file)")
    assert "max restarts" not in text and "last failure: worker 0 (pid 300)" in text
    assert text.endswith("    Segmentation fault")


@pytest.mark.timeout(5)
@pytest.mark.parametrize("limit, window, flag", [(0, 10.0, "--restart-limit"), (3, 0.0, "--restart-window")])
def test_bad_rates_name_the_flag(limit: int, window: float, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        RestartRate(limit, window)


# --- flags, job file, env --------------------------------------------------------------------------


def _args(argv: list[str]):
    return cli.build_parser().parse_args(["run", *argv])


@pytest.mark.timeout(10)
def test_flags_win_over_the_job_file_and_the_file_over_env(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    spec = cli.resolve_run(_args([str(script)]), {})
    assert spec.max_restarts == DEFAULT_MAX_RESTARTS == 32767 and spec.restart_rate == RestartRate(3, 3600.0)
    env = {"TG_RESTART_LIMIT": "7", "TG_RESTART_WINDOW": "120"}
    assert cli.resolve_run(_args([str(script)]), env).restart_rate == RestartRate(7, 120.0)
    job = tmp_path / "job.yaml"
    job.write_text(f"script: {script}\nrestart_limit: 5\nrestart_window: 600\nmax_restarts: 50\n")
    spec = cli.resolve_run(_args(["--config", str(job)]), env)
    assert spec.restart_rate == RestartRate(5, 600.0) and spec.max_restarts == 50
    spec = cli.resolve_run(_args(["--config", str(job), "--restart-limit", "2", "--max-restarts", "4"]), env)
    assert spec.restart_rate == RestartRate(2, 600.0) and spec.max_restarts == 4
    with pytest.raises(ConfigError, match="TG_RESTART_LIMIT"):
        restart_rate(_args([str(script)]), {"TG_RESTART_LIMIT": "0"})
    with pytest.raises(ConfigError, match="TG_RESTART_WINDOW"):
        restart_rate(_args([str(script)]), {"TG_RESTART_WINDOW": "soon"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("restart_limit: 0\n")
    with pytest.raises(ConfigError, match="restart_limit"):
        load_job_file(bad)
    assert LaunchSpec(script="x.py").max_restarts == DEFAULT_MAX_RESTARTS


# --- a real crash loop -------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_a_crash_loop_ends_the_job_with_the_defaults(tmp_path: Path) -> None:
    """Worker 0 dies right after every start; with no restart flag given, the job ends after 3 restarts of it
    (the default rate), naming the crash loop and the flags that change the limit."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time
        print("started", flush=True)
        if os.environ["TG_NODE_ID"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """))
    proc = subprocess.run([sys.executable, "-m", "trainguard", "run", "--workers", "2", "--hot-spares", "0",
                           "--recovery-path", str(tmp_path / "rec"), str(script)], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO), "TG_FAULT": ""}, capture_output=True, text=True,
                          timeout=80)
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    assert "max restarts 32767 (at most 3 per worker within 3600 s)" in err
    for n in (1, 2, 3):
        assert f"[agent] restarting worker 0 (restart {n}/32767)" in err
    assert "restart 4/" not in err and proc.stdout.count("[worker 0] started") == 4
    summary = err[err.index("trainguard: giving up after 3 restarts; root cause: worker 0 (pid "):]
    assert "  worker 0: crash loop: it failed again after 3 restarts of its own in " in summary
    assert "--restart-limit N / --restart-window SECONDS" in summary
