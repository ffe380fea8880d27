"""Plain variables that a rewind starts again (train/engine/plainvars.py; a blind port's early stop): after a kill -9,
the survivors that ran the script again name `best_val_loss`, which was the eval's best before the fault and is `inf`
now; the running sum and the step timer, which change at every step, and the epoch's start time are not named."""

import subprocess
import sys

from harness import REPO, env

from trainguard.train.engine.plainvars import differing, variables

JOB = REPO / "tests" / "jobs" / "early_stop.py"


def test_what_differs_at_the_resumed_step_and_did_not_change_at_every_step_before_is_named():
    before = [(3, {"best": 1.0, "total": 5.0, "i": 3}), (4, {"best": 0.5, "total": 6.0, "i": 4}),
              (5, {"best": 0.5, "total": 7.5, "i": 5})]
    assert differing(before, 5, {"best": float("inf"), "total": 0.0, "i": 5}) == [("best", 0.5, float("inf"))]
    assert differing(before, 4, {"best": float("inf"), "total": 0.0, "i": 4}) == [("best", 0.5, float("inf")),
                                                                                 ("total", 6.0, 0.0)]  # one before
    assert differing(before, 9, {"best": 2.0}) == []  # no note of that step: nothing to compare
    assert differing([(5, {"x": float("nan")})], 5, {"x": float("nan")}) == []


def test_the_scripts_ints_and_floats_are_noted_but_clocks():
    import time

    best_val_loss, patience, started, name, flag = 1e9, 2, time.perf_counter(), "x", True  # noqa: F841
    now = variables(sys._getframe())
    key = "({})".format(sys._getframe().f_code.co_name)
    assert now[f"best_val_loss {key}"] == 1e9 and now[f"patience {key}"] == 2
    assert f"started {key}" not in now and f"name {key}" not in now and f"flag {key}" not in now


def test_a_rewind_names_the_early_stop_state_the_script_keeps_in_plain_variables(tmp_path):
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", "3", "--recovery-path", str(tmp_path / "recovery"),
           str(JOB)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(TG_FAULT="1:15:kill"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "the script's plain variables differ" in line]
    assert said and all("best_val_loss (main)" in line and "inf now" in line for line in said), proc.stderr[-3000:]
    assert not any(name in line for line in said for name in ("running_loss", "dt (", "t0 (", "bad_epochs"))
