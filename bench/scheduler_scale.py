"""The scheduler under N workers: a real `trainguard scheduler` process against N simulated workers
(trainguard/testing/simworkers.py: asyncio clients speaking the real wire protocol, the job-secret
handshake included, one connection each).

For recovery off and on (cluster.db, events.jsonl), it reports:
- the time for N registrations (connect + handshake + register, `--concurrency` at a time);
- the heartbeats of all N at the default interval for `--seconds`: the rate held, p50/p99 latency;
- (recovery on) the time from one worker's last heartbeat to its fencing (failure_detected);
- the scheduler's RSS;
- (recovery on) a kill -9 of the scheduler: the time until a new one on the same port has all N
  members reattached (each sends its next heartbeat to it).

    python bench/scheduler_scale.py --workers 10000 [--runs 3]

The clients run on the same machine as the scheduler, so what they spend is not the scheduler's: both
CPU figures are printed. They are kept cheap: a protocol per connection rather than streams, `--concurrency`
lanes rather than a task per worker queued on a semaphore (Python 3.11's semaphore scans its waiters on
every release), and uvloop where it is installed (the dev extras install it). The scheduler runs on
asyncio's own loop, as `trainguard scheduler` does: on uvloop its group commit (control/commit.py) found
one request per pass, and 10,000 registrations took 8,714 fsyncs instead of 80 (strace, registrations
alone).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainguard.control import protocol as p  # noqa: E402
from trainguard.control.sched_main import tune_gc  # noqa: E402
from trainguard.testing.simworkers import SchedulerUnderTest, SimWorker  # noqa: E402

SECRET = "a secret for the scale benchmark, 32+ chars"
INTERVAL_S, TIMEOUT_S = 0.5, 5.0  # the defaults (config.py)
PER_HOST = 8  # workers per simulated host, with --heartbeats relay


def client_loop_runner(wanted: str):
    """The simulated clients' event loop: uvloop's where it is installed and not declined (their CPU halves)."""
    if wanted != "asyncio":
        try:
            import uvloop
        except ImportError:
            if wanted == "uvloop":
                raise SystemExit("--client-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        else:
            return uvloop.run, "uvloop"
    return asyncio.run, "asyncio"


def own_cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the scheduler child inherits it


class Load:
    """N simulated workers: each connects and registers. Direct: each then beats every INTERVAL_S on its
    connection, as a worker does without the relay. Relay: an agent per PER_HOST workers beats for those
    of them registered, as launch/relay.py does. The last worker falls silent once `quiet_now` is set."""

    def __init__(self, workers: list[SimWorker], port: int, secret: bytes, concurrency: int, relay: bool):
        self.workers, self.port, self.secret, self.relay = workers, port, secret, relay
        self.concurrency = concurrency  # connections + registrations in flight at once
        self.all_registered = asyncio.Event()
        self.beats: list[tuple[float, float, int]] = []  # (monotonic time sent, latency, workers it covered)
        self.quiet = workers[-1]
        self.quiet_now = False
        self.quiet_last_ack = 0.0  # monotonic time a beat for it was last acknowledged
        self.stop_at = float("inf")
        groups = [workers[i:i + PER_HOST] for i in range(0, len(workers), PER_HOST)]
        self.agents = [(SimWorker(f"agent{i}"), f"sim{i}", group) for i, group in enumerate(groups)] if relay else []

    def host_of(self, w: SimWorker) -> str:
        return f"sim{int(w.node_id) // PER_HOST}" if self.relay else "sim"

    async def register_all(self) -> None:
        """`concurrency` lanes, each registering the next worker not yet taken (a lane per registration in
        flight, not a task per worker queued on a semaphore: on Python 3.11 each release of a semaphore with
        10,000 waiters scans them, and the clients would measure that)."""
        queue = iter(self.workers)
        beats: list[asyncio.Task] = []

        async def lane() -> None:
            for w in queue:
                await w.connect("127.0.0.1", self.port, self.secret)
                reply = await w.register(len(self.workers), host=self.host_of(w))
                if not isinstance(reply, p.Registered):
                    raise SystemExit(f"registration of {w.node_id} refused: {reply}")
                if not self.relay:
                    beats.append(asyncio.create_task(self.beat(w, None, [w])))

        await asyncio.gather(*(lane() for _ in range(self.concurrency)))
        self.all_registered.set()
        await asyncio.gather(*beats)

    async def agent(self, conn: SimWorker, host: str, group: list[SimWorker]) -> None:
        await conn.connect("127.0.0.1", self.port, self.secret)
        await self.beat(conn, host, group)

    async def beat(self, conn: SimWorker, host: str | None, group: list[SimWorker]) -> None:
        tick = time.monotonic() + random.uniform(0, INTERVAL_S)
        while tick < self.stop_at:
            await asyncio.sleep(max(0.0, tick - time.monotonic()))
            members = [w for w in group if w.incarnation and not (w is self.quiet and self.quiet_now)]
            if members:
                sent = time.monotonic()
                reply = await (conn.heartbeat() if host is None else conn.host_beat(host, members))
                self.beats.append((sent, time.monotonic() - sent, len(members)))
                if isinstance(reply, p.Error) or getattr(reply, "refused", None):
                    raise SystemExit(f"heartbeat refused: {reply}")
                if self.quiet in members:
                    self.quiet_last_ack = time.monotonic()
            elif host is None:
                return  # the quiet worker: silent from now on
            tick += INTERVAL_S
            while tick < time.monotonic():  # late: skip the beats that were missed, as a worker's thread does
                tick += INTERVAL_S


def fenced_at(events: Path, node_id: str, deadline: float) -> float | None:
    """Monotonic time at which this bench saw `node_id`'s failure_detected in events.jsonl (polling the
    new lines only: re-reading 10,000 registrations every poll would slow the clients it measures)."""
    offset, rest = 0, b""
    while time.monotonic() < deadline:
        if events.exists():
            with open(events, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            *lines, rest = (rest + chunk).split(b"\n")
            for line in lines:
                if b"failure_detected" in line:
                    ev = json.loads(line)
                    if ev.get("event") == "failure_detected" and ev.get("node") == node_id:
                        return time.monotonic()
        time.sleep(0.02)
    return None


async def reattach_all(beaters: list[tuple[SimWorker, str | None, list[SimWorker]]], port: int, secret: bytes,
                       concurrency: int) -> float:
    """After a scheduler restart: every beater reconnects and beats once (a beat reattaches its workers)."""
    queue = iter(beaters)

    async def lane() -> None:
        for conn, host, group in queue:
            conn.close()
            while True:
                try:
                    await conn.connect("127.0.0.1", port, secret)
                    break
                except OSError:
                    await asyncio.sleep(0.05)
            reply = await (conn.heartbeat() if host is None else conn.host_beat(host, group))
            if isinstance(reply, p.Error) or getattr(reply, "refused", None):
                raise SystemExit(f"reattach refused: {reply}")

    t = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return time.perf_counter() - t


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


async def run(n: int, recovery: bool, relay: bool, args: argparse.Namespace, tmp: Path) -> dict:
    secret_file = tmp / "job.secret"
    secret = secret_file.read_bytes().strip()
    rdir = tmp / f"{'relay' if relay else 'direct'}-recovery-{'on' if recovery else 'off'}"
    rdir.mkdir()
    sched = SchedulerUnderTest(n, rdir if recovery else None, secret_file, log=rdir / "scheduler.log")
    workers = [SimWorker(str(i)) for i in range(n)]
    load = Load(workers, sched.port, secret, args.concurrency, relay)
    out: dict = {}
    try:
        t, cpu, own = time.perf_counter(), sched.cpu_s(), own_cpu_s()
        tasks = asyncio.gather(load.register_all(), *(load.agent(*a) for a in load.agents))
        await load.all_registered.wait()
        out["register_s"] = time.perf_counter() - t
        out["register_cpu_s"] = sched.cpu_s() - cpu
        out["clients_cpu_s"] = own_cpu_s() - own
        window = time.monotonic() + 1.0  # steady state: from a second after the last registration
        load.stop_at = window + args.seconds
        fenced = None
        if recovery:
            await asyncio.sleep(1.0)
            load.quiet_now = True  # from its next tick on, the last worker is silent
            fenced = await asyncio.to_thread(fenced_at, rdir / "events.jsonl", load.quiet.node_id,
                                             load.stop_at + TIMEOUT_S + 10)
        await tasks
        steady = [(lat, covered) for sent, lat, covered in load.beats if window <= sent < load.stop_at]
        out["frames_per_s"] = len(steady) / args.seconds
        out["beats_per_s"] = sum(covered for _, covered in steady) / args.seconds
        steady = [lat for lat, _ in steady]
        out["p50_ms"], out["p99_ms"] = pct(steady, 50) * 1e3, pct(steady, 99) * 1e3
        out["rss_mb"] = sched.rss_mb()
        if recovery:
            out["fenced_after_s"] = (fenced - load.quiet_last_ack) if fenced else float("nan")
            sched.kill()
            t = time.perf_counter()
            sched = SchedulerUnderTest(n, rdir, secret_file, port=sched.port, log=rdir / "scheduler.log")
            started = time.perf_counter() - t
            beaters = ([(a, host, [w for w in group if w is not load.quiet]) for a, host, group in load.agents]
                       or [(w, None, [w]) for w in workers[:-1]])  # the quiet one is dead
            out["restart_s"] = started + await reattach_all(beaters, sched.port, secret, args.concurrency)
    finally:
        for w in workers + [a for a, _, _ in load.agents]:
            w.close()
        sched.kill()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=10.0, help="of heartbeats at the default interval")
    parser.add_argument("--concurrency", type=int, default=500, help="registrations in flight at once")
    parser.add_argument("--heartbeats", choices=("relay", "direct", "both"), default="relay",
                        help=f"relay: an agent per {PER_HOST} workers beats for them (the default from "
                             "64 workers, launch/relay.py); direct: every worker beats on its own connection")
    parser.add_argument("--runs", type=int, default=1, help="recovery off and on alternate this many times; the "
                                                             "table shows each figure's median")
    parser.add_argument("--client-loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                        help="the simulated clients' event loop (auto: uvloop where installed)")
    args = parser.parse_args()
    raise_fd_limit()
    tune_gc()  # the clients' heap, like the scheduler's, is long-lived: full collections would stall them too
    modes = {"relay": (True,), "direct": (False,), "both": (True, False)}[args.heartbeats]
    run_clients, loop_name = client_loop_runner(args.client_loop)
    results = {}
    with tempfile.TemporaryDirectory(prefix="tg-scale-") as d:
        tmp = Path(d)
        (tmp / "job.secret").write_text(SECRET)
        (tmp / "job.secret").chmod(0o600)
        for relay in modes:
            for i in range(args.runs):
                for recovery in (False, True):
                    sub = tmp / f"run{i}"
                    sub.mkdir(exist_ok=True)
                    (sub / "job.secret").write_text(SECRET)
                    (sub / "job.secret").chmod(0o600)
                    got = run_clients(run(args.workers, recovery, relay, args, sub))
                    results.setdefault((relay, recovery), []).append(got)
                    print(f"{'relay' if relay else 'direct'}, recovery {'on ' if recovery else 'off'}: "
                          f"{json.dumps({k: round(v, 3) for k, v in got.items()})}", flush=True)
        results = {k: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for k, runs in results.items()}
    n = args.workers
    print(f"\n{n} workers, heartbeat every {INTERVAL_S:g} s (timeout {TIMEOUT_S:g} s), {args.seconds:g} s of beats; "
          f"recovery off / on{f'; medians of {args.runs} runs' if args.runs > 1 else ''}; clients on {loop_name}")
    rows = [("registrations, s", "register_s", ".2f"),
            ("  the scheduler's CPU in them, s", "register_cpu_s", ".2f"),
            ("  the simulated clients' CPU in them, s (same machine)", "clients_cpu_s", ".2f"),
            (f"worker heartbeats per s (wanted {int(n / INTERVAL_S)})", "beats_per_s", ".0f"),
            ("frames per s at the scheduler", "frames_per_s", ".0f"),
            ("heartbeat round trip p50, ms", "p50_ms", ".1f"), ("heartbeat round trip p99, ms", "p99_ms", ".1f"),
            ("scheduler RSS, MB", "rss_mb", ".0f"),
            (f"silent worker fenced after its last beat, s (timeout {TIMEOUT_S:g})", "fenced_after_s", ".2f"),
            ("kill -9 of the scheduler -> all reattached, s", "restart_s", ".2f")]
    for relay in modes:
        print(f"\nheartbeats: {'relayed by an agent per ' + str(PER_HOST) + ' workers' if relay else 'direct'}")
        for label, key, fmt in rows:
            off, on = results[relay, False].get(key), results[relay, True].get(key)
            cells = [format(v, fmt) if v is not None else "-" for v in (off, on)]
            print(f"  {label:<62} {cells[0]:>8} {cells[1]:>8}")


if __name__ == "__main__":
    main()
