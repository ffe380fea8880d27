"""What the job secret costs on the control plane (control/auth.py): a heartbeat round trip on an
open connection, and opening a connection (TCP connect + handshake + one request), each against
a real scheduler with a secret and one without, alternating; medians and the ratio.

    python bench/control_plane.py [--rounds 2000] [--connects 300]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainguard.config import ClusterConfig, LaunchMode, Role  # noqa: E402
from trainguard.control import protocol as p  # noqa: E402
from trainguard.control.client import Connection  # noqa: E402
from trainguard.control.sched_main import start_in_thread  # noqa: E402

SECRET = b"a secret for the benchmark, 32 chars+"


def scheduler(secret):
    cfg = ClusterConfig(role=Role.SCHEDULER, mode=LaunchMode.DYNAMIC, sched_host="127.0.0.1", sched_port=0,
                        worker_num=1, secret=secret)
    sched, _ = start_in_thread(cfg)
    return ("127.0.0.1", sched.port)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2000, help="round trips per setup")
    parser.add_argument("--connects", type=int, default=300, help="connections opened per setup")
    args = parser.parse_args()
    addresses = {"secret": (scheduler(SECRET), SECRET), "open": (scheduler(None), None)}
    conns = {name: Connection(addr, 5, secret=secret) for name, (addr, secret) in addresses.items()}
    rtt = {name: [] for name in addresses}
    for _ in range(args.rounds):  # alternating, one round trip each
        for name, conn in conns.items():
            t = time.perf_counter()
            conn.request(p.Status(), 5)
            rtt[name].append(time.perf_counter() - t)
    setup = {name: [] for name in addresses}
    for _ in range(args.connects):
        for name, (addr, secret) in addresses.items():
            t = time.perf_counter()
            conn = Connection(addr, 5, secret=secret)
            conn.request(p.Status(), 5)
            setup[name].append(time.perf_counter() - t)
            conn.close()
    print(f"{'':<34} {'with secret':>12} {'open':>10} {'ratio':>6}")
    for label, data in (("round trip on an open connection", rtt), ("connect + handshake + request", setup)):
        a, b = statistics.median(data["secret"]) * 1e6, statistics.median(data["open"]) * 1e6
        print(f"{label:<34} {a:>9.0f} us {b:>7.0f} us {a / b:>6.2f}")


if __name__ == "__main__":
    main()
