"""Seeing what a job does: `trainguard status`, `trainguard report` (text, JSON, --plot), the Prometheus
endpoint and Model.train's progress bar; the timeline and status logic as pure functions."""

from __future__ import annotations

import io
import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from harness import JOB, REPO, env, free_port

from trainguard.config import ClusterConfig, LaunchMode, Role
from trainguard.control.metrics import families
from trainguard.control.sched_main import start_in_thread
from trainguard.control.status import JobView
from trainguard.launch.observe import render_status
from trainguard.obs.events import EventTail
from trainguard.obs.report import render
from trainguard.obs.timeline import PHASES, build, step_rate, summary
from trainguard.train.engine.progress import terminal, wants_bar

parser = pytest.importorskip("prometheus_client.parser")


def cli(*args: str, timeout: float = 60, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainguard", *args], env=env(**extra), capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def scrape(port: int) -> dict[str, float]:
    """Every sample of the endpoint, parsed by prometheus_client's own text parser: name{labels} -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


# --- a real job: 2 workers, one kill -9 ----------------------------------------------------------------


def test_status_metrics_report_and_plot_of_a_job_with_one_kill(tmp_path):
    rec, port = tmp_path / "recovery", free_port()
    log = open(tmp_path / "launcher.log", "w")
    job = subprocess.Popen(
        [sys.executable, "-m", "trainguard", "run", "--workers", "2", "--recovery-path", str(rec),
         "--metrics-port", str(port), str(JOB), "--out", str(tmp_path / "final"), "--level", "high",
         "--epochs", "12", "--step-sleep", "0.1", "--progress", "on", "--ckpt", str(tmp_path / "ckpt"),
         "--save-steps", "40", "--hold-until", str(tmp_path / "release")], env=env(), stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True)  # the job waits after its last step until released

    def status() -> dict | None:
        proc = cli("status", str(rec), "--json", timeout=30)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    def wait(pred, what: str, limit: float = 90.0):
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            got = pred()
            if got:
                return got
            assert job.poll() is None, f"the job ended before {what}: {(tmp_path / 'launcher.log').read_text()[-3000:]}"
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}")

    try:
        st = wait(lambda: (s := status()) and s["formed"] and (s["step"] or 0) >= 10 and s, "both ranks training")
        assert sorted(n["rank"] for n in st["nodes"]) == [0, 1]
        assert all(n["state"] == "alive" and n["heartbeat_age_s"] < 2 for n in st["nodes"])
        assert st["generation"] >= 1 and st["job"] == "running" and st["recoveries"] == []
        assert st["strategy"] == "recover-in-place"
        text = cli("status", str(rec)).stdout
        assert "rank" in text and "alive" in text and "recoveries: 0" in text

        before = wait(lambda: (m := scrape(port)).get("trainguard_steps_total", 0) > 0 and m, "metrics")
        assert before["trainguard_generation"] == st["generation"]
        assert before["trainguard_workers{state=alive}"] == 2
        assert sum(v for k, v in before.items() if k.startswith("trainguard_recoveries_total")) == 0
        secret = (rec / "job.secret").read_text().strip()
        assert secret not in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()

        victim = next(n for n in st["nodes"] if n["rank"] == 1)
        os.kill(victim["pid"], signal.SIGKILL)
        after = wait(lambda: (s := status()) and len(s["recoveries"]) == 1 and s["recoveries"][0]["mttr_s"]
                     and s, "the recovery in status")
        r = after["recoveries"][0]
        assert r["ranks"] == [1] and r["generation"] > st["generation"] and r["lost_steps"] is not None
        assert after["generation"] == r["generation"]
        metrics = wait(lambda: (m := scrape(port)).get("trainguard_recovery_seconds_count{phase=total}", 0) >= 1
                       and m, "the completed recovery in the metrics (published once a second)")
        assert sum(v for k, v in metrics.items() if k.startswith("trainguard_recoveries_total")) == 1
        assert all("strategy=recover-in-place" in k for k in metrics if k.startswith("trainguard_recoveries_total"))
        assert metrics["trainguard_recovery_seconds_count{phase=total}"] == 1
        (tmp_path / "release").touch()
        assert job.wait(timeout=120) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGTERM)
            try:
                job.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
        log.close()

    output = (tmp_path / "launcher.log").read_text()
    assert "recovered: generation" in output  # the progress bar marks the recovery
    assert "epoch 12/12" in output and "step/s" in output and "epoch 13" not in output

    report = cli("report", str(rec), "--plot", str(tmp_path / "timeline.png"))
    assert report.returncode == 0, report.stderr
    for phase in PHASES:
        assert f"{phase} ms" in report.stdout
    assert "rank 1 (" in report.stdout
    assert "goodput:" in report.stdout and "failures: 1 " in report.stdout
    width, height = png_size(tmp_path / "timeline.png")
    assert width >= 600 and height >= 300 and (tmp_path / "timeline.png").stat().st_size > 20_000
    data = json.loads(cli("report", str(rec), "--json").stdout)
    assert len(data["recoveries"]) == 1 and set(data["recoveries"][0]["phases"]) == set(PHASES)


def test_status_and_report_refuse_what_is_not_a_job(tmp_path):
    bare = cli("status", str(tmp_path))
    assert bare.returncode == 2 and "scheduler's address" in bare.stderr and "recovery path" in bare.stderr
    (tmp_path / "scheduler.json").write_text(json.dumps({"host": "127.0.0.1", "port": free_port()}))
    gone = cli("status", str(tmp_path))
    assert gone.returncode == 2 and "no status from the scheduler" in gone.stderr
    (tmp_path / "scheduler.json").write_text('{"host": 5}')
    assert "is not what a scheduler writes" in cli("status", str(tmp_path)).stderr
    missing = cli("report", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "no event log" in missing.stderr
    assert cli("status").returncode == 2


def test_a_stranger_without_the_secret_gets_no_status(tmp_path):
    rec = tmp_path / "recovery"
    job = subprocess.Popen([sys.executable, "-m", "trainguard", "run", "--workers", "1", "--recovery-path", str(rec),
                            "--hot-spares", "0", str(JOB), "--out", str(tmp_path / "final"), "--epochs", "40",
                            "--step-sleep", "0.02"], env=env(), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (rec / "scheduler.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        port = json.loads((rec / "scheduler.json").read_text())["port"]
        wrong = cli("status", "--sched-port", str(port), TG_JOB_SECRET="x" * 32)
        assert wrong.returncode == 2 and "no status from the scheduler" in wrong.stderr
        assert "secret" in wrong.stderr.lower()
        right = cli("status", "--sched-port", str(port), "--json", TG_JOB_SECRET_FILE=str(rec / "job.secret"))
        assert right.returncode == 0 and json.loads(right.stdout)["worker_num"] == 1
    finally:
        job.send_signal(signal.SIGTERM)  # the agent stops its workers (they run in their own sessions)
        try:
            job.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def test_the_metrics_endpoint_serves_the_job_from_the_moment_it_listens(tmp_path):
    """Before any worker came and before the scheduler's loop first ran its monitor, a scrape gets the job:
    a scraper that hits a fresh job is never handed an empty page (a CI run once was)."""
    cfg = ClusterConfig(role=Role.SCHEDULER, mode=LaunchMode.DYNAMIC, sched_host="127.0.0.1", sched_port=0,
                        worker_num=2, recovery_path=tmp_path / "recovery", secret=b"metrics-test-secret-0123456789",
                        metrics_port=free_port(), metrics_host="127.0.0.1")
    scheduler, _ = start_in_thread(cfg)
    first = scrape(cfg.metrics_port)
    assert first["trainguard_generation"] == scheduler.cluster.generation and first["trainguard_job_running"] == 1
    assert first["trainguard_workers{state=alive}"] == 0 and first["trainguard_steps_total"] == 0


# --- pure parts ----------------------------------------------------------------------------------------


def recovery_events(t: float = 100.0) -> list[dict]:
    """One kill of rank 1 at t+1 in a 2-rank job, recovered into generation 2 from a peer, 3 steps lost."""
    return [
        {"ts": t, "event": "scheduler_started"},
        *({"ts": t + 0.1 * i, "event": "progress", "rank": 0, "step": 10 * i, "generation": 1} for i in range(10)),
        {"ts": t + 1.0, "event": "fault_injected", "rank": 1, "how": "kill-exchange", "generation": 1},
        {"ts": t + 1.02, "event": "failure_detected", "rank": 1, "node": "1", "kind": "exit", "generation": 1,
         "next_generation": 2},
        {"ts": t + 1.01, "event": "left_generation", "rank": 0, "generation": 1},  # left before detection
        {"ts": t + 1.03, "event": "left_generation", "rank": 0, "generation": 1},
        {"ts": t + 1.05, "event": "generation_formed", "generation": 2, "world_size": 2},
        {"ts": t + 1.06, "event": "agreed_restore", "generation": 2, "step": 87},
        {"ts": t + 1.07, "event": "restore_step", "generation": 2, "to_step": 87, "from_step": 90},
        {"ts": t + 1.08, "event": "restored", "generation": 2, "rank": 0, "source": "self"},
        {"ts": t + 1.09, "event": "restored", "generation": 2, "rank": 1, "source": "peer"},
        {"ts": t + 1.10, "event": "step_finished", "generation": 2, "rank": 0, "step": 88},
        {"ts": t + 1.12, "event": "step_finished", "generation": 2, "rank": 1, "step": 88},
        {"ts": t + 1.5, "event": "checkpoint_saved", "step": 120, "seconds": 0.2, "bytes": 1000},
        {"ts": t + 2.0, "event": "progress", "rank": 0, "step": 170, "generation": 2},
        {"ts": t + 2.1, "event": "graceful_exit", "rank": 0, "step": 180, "signal": "SIGTERM"},
    ]


def test_a_recovery_splits_into_phases_that_add_up():
    tl = build(recovery_events())
    (rec,) = tl.recoveries
    assert [p.name for p in rec.phases] == list(PHASES)
    took = {p.name: round(p.seconds, 6) for p in rec.phases}
    assert took == {"detect": 0.02, "fence": 0.01, "regroup": 0.02, "agree": 0.01, "restore": 0.03,
                    "first step": 0.03}
    assert rec.total_s == pytest.approx(0.12) and rec.mttr_s == pytest.approx(0.10)
    assert rec.lost_steps == 3 and rec.sources == ["peer", "self"] and rec.cause == "exit"
    assert rec.rank_marks[1] == pytest.approx({"restored": 101.09, "stepped": 101.12})
    assert tl.ranks == [0, 1] and len(tl.checkpoints) == 1 and len(tl.stops) == 1
    s = summary(tl)
    assert s["failures"] == 1 and s["unrecovered"] == 0
    assert s["step_s"] == pytest.approx(0.01)  # 10 steps per 0.1 s
    assert s["lost_s"] == pytest.approx(0.12 + 3 * 0.01)
    assert s["goodput"] == pytest.approx(1 - s["lost_s"] / 2.1)
    text = render(tl)
    assert "rank 1 (exit)" in text and "goodput: 9" in text


def test_an_unfinished_recovery_has_only_the_phases_that_happened():
    evs = [e for e in recovery_events() if e["event"] not in ("restored", "step_finished")]
    (rec,) = build(evs).recoveries
    assert [p.name for p in rec.phases] == ["detect", "fence", "regroup", "agree"]
    assert rec.total_s is None
    assert build([]).recoveries == [] and render(build([])) == "no events yet"


def test_step_rate_counts_lost_steps_as_no_progress():
    assert step_rate([(0.0, 0), (1.0, 10), (2.0, 5), (3.0, 15)]) == [(0.5, 10.0), (1.5, 0.0), (2.5, 10.0)]


def test_the_event_tail_reads_only_whole_lines_and_keeps_what_it_needs(tmp_path):
    path = tmp_path / "events.jsonl"
    tail = EventTail(path)
    assert not tail.update()  # no file yet
    path.write_text('{"ts": 1, "event": "failure_detected", "rank": 1}\n{"ts": 2, "event": "progress", "step": 3}\n'
                    '{"ts": 3, "event": "spares", "agent": 0, "ready": 1}\n{"ts": 4, "event": "checkpoint_sa')
    assert tail.update()
    assert [e["event"] for e in tail.events] == ["failure_detected"] and tail.spares == {0: 1}
    with open(path, "a") as f:
        f.write('ved", "seconds": 0.5, "bytes": 7}\nnot json\n')
    tail.update()
    assert tail.checkpoints == [(0.5, 7)] and len(tail.events) == 1


def test_the_step_rate_from_heartbeats_survives_lost_steps():
    view = JobView(None, "recover")
    for t, step in ((0.0, 0), (1.0, 10), (2.0, 20)):
        view.heartbeat("0", step, t)
        view.heartbeat("1", step, t + 0.1)
    assert view.step_rate() == pytest.approx(10.0) and view.steps_done == 20
    view.steps.clear()  # every member rolled back to step 15
    view.heartbeat("0", 15, 3.0)
    view.heartbeat("0", 25, 4.0)
    assert view.step_rate() == pytest.approx(10.0) and view.steps_done == 30


def test_metrics_follow_prometheus_conventions():
    from prometheus_client import CollectorRegistry, generate_latest

    st = {"generation": 3, "job": "running", "strategy": "recover", "step": 40, "step_rate": 20.0, "steps_done": 45,
          "nodes": [{"state": "alive"}, {"state": "alive"}, {"state": "dead"}],
          "recoveries": [{"cause": "exit", "phases": {"detect": 0.02, "fence": 0.0}, "total_s": 0.3},
                         {"cause": "exit", "phases": {"detect": 0.5}, "total_s": None}],
          "checkpoints": [(0.2, 100), (0.4, 300)], "spares": {0: 1}}

    class One:
        def collect(self):
            return families(st)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(One())
    text = generate_latest(registry).decode()
    got = {s.name + str(sorted(s.labels.items())): s.value for f in parser.text_string_to_metric_families(text)
           for s in f.samples}
    assert got["trainguard_recoveries_total[('cause', 'exit'), ('strategy', 'recover')]"] == 2
    assert got["trainguard_workers[('state', 'dead')]"] == 1
    assert got["trainguard_recovery_seconds_count[('phase', 'detect')]"] == 2
    assert got["trainguard_recovery_seconds_bucket[('le', '0.025'), ('phase', 'detect')]"] == 1
    assert got["trainguard_recovery_seconds_count[('phase', 'total')]"] == 1
    assert got["trainguard_step_seconds[]"] == 0.05 and got["trainguard_steps_total[]"] == 45
    assert got["trainguard_checkpoint_bytes_total[]"] == 400
    assert got["trainguard_hot_spares_ready[('agent', '0')]"] == 1
    assert "# TYPE trainguard_recovery_seconds histogram" in text


def test_status_text_names_every_member_and_recovery():
    st = {"job": "running", "generation": 2, "formed": True, "strategy": "recover", "worker_num": 2, "uptime_s": 9,
          "step": 50, "step_rate": 12.5, "spares": {"0": 1}, "root_cause": "",
          "nodes": [{"rank": r, "node_id": str(r), "host": "h", "pid": 10 + r, "incarnation": 1 + r,
                     "state": "alive", "step": 50, "heartbeat_age_s": 0.2} for r in (0, 1)],
          "recoveries": [{"index": 1, "ts": 0.0, "ranks": [1], "cause": "exit", "generation": 2, "mttr_s": 0.11,
                          "lost_steps": 0, "sources": ["peer"]}]}
    text = render_status(st)
    assert "generation 2 (formed)" in text and "12.50 steps/s" in text and "agent 0: 1" in text
    assert "MTTR 0.110 s, lost 0 steps, from peer" in text and text.count("alive") == 2


def test_the_progress_bar_is_on_for_a_terminal_on_rank_0_only():
    tty = io.StringIO()
    tty.isatty = lambda: True
    assert wants_bar(None, 0, tty) and not wants_bar(None, 0, io.StringIO())
    assert not wants_bar(None, 1, tty) and not wants_bar(True, 1, tty)
    assert wants_bar(True, 0, io.StringIO()) and not wants_bar(False, 0, tty)
    # under `trainguard run` stderr is a pipe to the agent; the agent names its terminal, if it has one
    assert wants_bar(None, 0, io.StringIO(), {"TG_TERMINAL": "/dev/pts/0"}) and not wants_bar(None, 0, io.StringIO(), {})


def test_the_bar_draws_only_on_a_character_device(tmp_path):
    (tmp_path / "f").write_text("")
    assert terminal({"TG_TERMINAL": str(tmp_path / "f")}) is None  # a path we would write to: only a terminal
    assert terminal({"TG_TERMINAL": str(tmp_path / "missing")}) is None and terminal({}) is None
    dev = terminal({"TG_TERMINAL": os.devnull})  # a character device, as a terminal is
    assert dev is not None
    dev.close()
