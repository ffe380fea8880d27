"""The examples, run as a user runs them: through `trainguard run`, with real processes."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from harness import REPO, assert_identical, env

import trainguard as tg

pytestmark = pytest.mark.timeout(300)


def run(*args: str, faults: str = "", timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainguard", "run", *args]
    # the defaults a user gets (heartbeat timeout 5 s), not the harness's fast detection
    e = env(TG_FAULT=faults, TG_HEARTBEAT_INTERVAL="0.5", TG_HEARTBEAT_TIMEOUT="5")
    proc = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_allgather_on_four_workers():
    proc = run("--workers", "4", "--hot-spares", "0", "examples/allgather.py")
    for rank in range(4):
        assert f"[worker {rank}] [[0.],[1.],[2.],[3.]]" in proc.stdout.splitlines(), proc.stdout


def test_digits_accuracy_and_replicas_identical_after_every_step():
    proc = run("--workers", "2", "--hot-spares", "0", "examples/digits.py", "--check-replicas")
    acc = {int(r): float(a) for r, a in re.findall(r"rank (\d): test accuracy ([0-9.]+)", proc.stdout)}
    assert sorted(acc) == [0, 1] and min(acc.values()) >= 0.95, proc.stdout[-2000:]
    checked = re.findall(r"rank \d: weights identical on every rank after each of (\d+) steps", proc.stdout)
    assert len(checked) == 2 and all(int(n) == 264 for n in checked)  # 12 epochs x 22 steps
    assert re.search(r"epoch: 12 step: 20, loss is [0-9.]+", proc.stdout)  # LossMonitor, seed style


def test_digits_demo_kill_is_bit_identical(tmp_path):
    """The README's demo: rank 1 is kill -9'd after step 100 and replaced; the result does not change."""
    clean = run("--workers", "2", "--hot-spares", "0", "examples/digits.py", "--epochs", "6", "--out",
                str(tmp_path / "clean.st"))  # nothing to replace: no warm spare taking CPU from the workers
    faulty = run("--workers", "2", "examples/digits.py", "--epochs", "6", "--out", str(tmp_path / "faulty.st"),
                 faults="1:100:kill")
    assert "injecting kill at step 100 on rank 1" in faulty.stdout
    line = re.search(r"trainguard: recovery 1: rank 1 .* resumed at step 100, lost 0 steps, MTTR ([0-9.]+) s",
                     faulty.stdout)
    assert line and "recovery 2" not in faulty.stdout, faulty.stdout[-3000:]
    assert "recovery 1" not in clean.stdout
    assert_identical(tg.load_state(tmp_path / "faulty.st"), tg.load_state(tmp_path / "clean.st"), "final state")


def test_kubernetes_manifest_maps_to_trainguard_run():
    """examples/k8s: no cluster runs here, so the manifest is checked as far as it can be: it parses, and it
    says what examples/k8s/README.md says it does (and `trainguard run` accepts its flags)."""
    import yaml

    from trainguard.launch.cli import build_parser

    service, job = yaml.safe_load_all((REPO / "examples" / "k8s" / "trainguard-job.yaml").read_text())
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 3
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    (container,) = pod["containers"]
    line = container["args"][0].split()
    assert line[:3] == ["exec", "trainguard", "run"]
    flags = dict(zip(line[3::2], line[4::2]))
    assert flags["--nnodes"] == "3" and flags["--node-rank"] == '"$JOB_COMPLETION_INDEX"'
    assert flags["--sched-host"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert pod["terminationGracePeriodSeconds"] > float(flags["--grace-period"])
    assert {"name": "TG_JOB_SECRET_FILE", "value": "/etc/trainguard/job.secret"} in container["env"]
    assert "TG_JOB_SECRET" not in container["args"][0]
    rules = spec["podFailurePolicy"]["rules"]
    assert any(r["action"] == "FailJob" and r["onExitCodes"]["values"] == [78] for r in rules)
    args = [a.strip('"').replace("$JOB_COMPLETION_INDEX", "1") for a in line[3:]]
    parsed = build_parser().parse_args(["run", *args])  # the flags are trainguard run's
    assert parsed.nnodes == 3 and parsed.node_rank == 1
