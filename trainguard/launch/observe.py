"""`trainguard status` (a running job, from its scheduler) and `trainguard report` (any job, running or
finished, from its events.jsonl).

    trainguard status RECOVERY_PATH [--json] [--watch SECONDS]
    trainguard status --sched-host H --sched-port P          # secret: TG_JOB_SECRET(_FILE)
    trainguard report RECOVERY_PATH [--json] [--plot timeline.png]

`status` asks the scheduler over the job's authenticated connection, as the job's own processes do:
with RECOVERY_PATH it reads the address from scheduler.json and the secret from job.secret there
(both owner-only files `trainguard run` writes), so only the job's user can ask.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ..config import read_secret
from ..errors import ConfigError, TrainguardError

MAX_FILE_BYTES = 4096  # scheduler.json and job.secret are a line each


def add_parsers(sub) -> None:
    status = sub.add_parser("status", help="a running job: generation, members, steps, recoveries, hot spares")
    status.add_argument("recovery_path", nargs="?", type=Path, help="the job's recovery path (--recovery-path of "
                        "trainguard run; its first line says where)")
    status.add_argument("--sched-host", dest="sched_host", default="127.0.0.1", help="without RECOVERY_PATH")
    status.add_argument("--sched-port", dest="sched_port", type=int, help="without RECOVERY_PATH")
    status.add_argument("--json", action="store_true", help="print the scheduler's answer as JSON")
    status.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until the job ends")
    status.set_defaults(handler=status_cmd)
    report = sub.add_parser("report", help="a job's recoveries phase by phase, the time they cost, a timeline picture")
    report.add_argument("recovery_path", type=Path, help="the job's recovery path (or its events.jsonl)")
    report.add_argument("--json", action="store_true", help="print the timeline as JSON")
    report.add_argument("--plot", type=Path, metavar="PNG", help="draw the timeline (needs trainguard[plot])")
    report.set_defaults(handler=report_cmd)


# --- status ---------------------------------------------------------------------------------


def _small_file(path: Path, what: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path} ({exc.strerror}); is this the job's recovery path, and is the "
                          "job running?") from None
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{path} is larger than {what} can be; not reading it")
    return data


def target(args: argparse.Namespace, env) -> tuple[tuple[str, int], bytes | None]:
    """(scheduler address, secret) from RECOVERY_PATH or the flags and TG_JOB_SECRET(_FILE)."""
    if args.recovery_path is None:
        if args.sched_port is None:
            raise ConfigError("give the job's RECOVERY_PATH, or --sched-port (and --sched-host)")
        return (args.sched_host, args.sched_port), read_secret(env)
    from ..control.status import SCHEDULER_FILE
    from .secret import SECRET_FILE

    raw = _small_file(args.recovery_path / SCHEDULER_FILE, "the scheduler's address")
    try:
        where = json.loads(raw)
        host, port = where["host"], where["port"]
        if not isinstance(host, str) or not isinstance(port, int):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{args.recovery_path / SCHEDULER_FILE} is not what a scheduler writes") from None
    secret = read_secret(env)
    if secret is None and (args.recovery_path / SECRET_FILE).exists():
        secret = _small_file(args.recovery_path / SECRET_FILE, "the job secret").strip() or None
    return (host, port), secret


def _age(seconds) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s ago"


def render_status(st: dict) -> str:
    """The text of `trainguard status` (pure)."""
    from ..obs.report import table

    rate = st.get("step_rate")
    spares = st.get("spares") or {}
    lines = [f"job {st['job']}, generation {st['generation']} ({'formed' if st['formed'] else 'forming'}), "
             f"recover strategy {st.get('strategy', '?')}, {st['worker_num']} workers, scheduler up "
             f"{st.get('uptime_s', 0):.0f} s",
             f"step {st.get('step') if st.get('step') is not None else '-'}, "
             + (f"{rate:.2f} steps/s" if rate else "no step rate yet")
             + "; hot spares ready: " + (", ".join(f"agent {a}: {n}" for a, n in spares.items()) or "none reported")]
    if st.get("root_cause"):
        lines.append(f"root cause: {st['root_cause']}")
    rows = [[str(n["rank"]), n["node_id"], n["host"], str(n["pid"]), str(n["incarnation"]), n["state"],
             "-" if n.get("step") is None else str(n["step"]), _age(n.get("heartbeat_age_s")),
             _age(n.get("idle_s")), n.get("waiting") or "-"] for n in st["nodes"]]
    lines += ["", table(["rank", "node", "host", "pid", "incarnation", "state", "step", "heartbeat", "progress",
                         "waits in"], rows)]
    recs = st.get("recoveries") or []
    lines += ["", f"recoveries: {len(recs)}"]
    for r in recs:
        mttr = f"MTTR {r['mttr_s']:.3f} s" if r.get("mttr_s") is not None else "not recovered yet"
        lost = "?" if r.get("lost_steps") is None else r["lost_steps"]
        at = time.strftime("%H:%M:%S", time.localtime(r["ts"]))
        lines.append(f"  #{r['index']} at {at}: rank {', '.join(str(x) for x in r['ranks']) or '?'} ({r['cause']}) "
                     f"-> generation {r['generation']}, {mttr}, lost {lost} steps, from "
                     f"{', '.join(r.get('sources') or []) or '-'}")
    for line in st.get("verdicts") or []:  # replay mismatches, desyncs, hangs (obs/timeline.verdict_line)
        lines.append(f"  {line}")
    return "\n".join(lines)


def status_cmd(args: argparse.Namespace) -> int:
    from ..control.client import query_status  # lazy: the CLI starts without the client

    if args.watch is not None and args.watch <= 0:
        raise ConfigError(f"--watch needs a positive number of seconds, got {args.watch:g}")
    address, secret = target(args, os.environ)
    shown = 0
    while True:
        try:
            st = query_status(address, timeout=5.0, secret=secret)
        except (TrainguardError, OSError) as exc:
            if shown and args.watch is not None:
                print(f"trainguard status: the scheduler stopped answering ({exc}); the job has ended", file=sys.stderr)
                return 0
            raise ConfigError(f"no status from the scheduler at {address[0]}:{address[1]}: {exc}") from None
        text = json.dumps(st, indent=2, sort_keys=True) if args.json else render_status(st)
        if args.watch is not None and sys.stdout.isatty():
            text = "\x1b[H\x1b[2J" + text  # redraw in place
        print(text, flush=True)
        shown += 1
        if args.watch is None or st.get("job") != "running":
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0


# --- report ---------------------------------------------------------------------------------


def report_cmd(args: argparse.Namespace) -> int:
    from ..obs.events import EventLog
    from ..obs.report import as_json, render
    from ..obs.timeline import build

    path = args.recovery_path
    if path.is_dir():
        path = path / "events.jsonl"
    if not path.is_file():
        raise ConfigError(f"no event log at {path}: give the job's recovery path (trainguard run prints it on its "
                          "first line) or its events.jsonl")
    tl = build(EventLog.read(path))
    print(json.dumps(as_json(tl), indent=2, default=str) if args.json else render(tl))
    if args.plot is not None:
        from ..obs.plot import plot

        print(f"timeline: {plot(tl, args.plot)}", file=sys.stderr)
    return 0
