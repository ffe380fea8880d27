"""What authentication costs on the control plane: a request's round trip on an open connection, and
opening a connection (TCP connect + handshakes + one request), against three real schedulers (threads
of this process), in a new random order each round: without a secret ("open"), with the job secret (control/auth.py), and with the secret inside
mutual TLS (control/tls.py, certificates from `trainguard certs` in a temporary folder); medians,
and each one's ratio to "open".

    python bench/control_plane.py [--rounds 2000] [--connects 300]
"""

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainguard import tlsconfig  # noqa: E402
from trainguard.config import ClusterConfig, LaunchMode, Role  # noqa: E402
from trainguard.control import protocol as p  # noqa: E402
from trainguard.control import tls  # noqa: E402
from trainguard.control.client import Connection  # noqa: E402
from trainguard.control.sched_main import start_in_thread  # noqa: E402
from trainguard.launch.certs import make_test_pki  # noqa: E402

SECRET = b"a secret for the benchmark, 32 chars+"


def scheduler(secret, tls_config=None):
    cfg = ClusterConfig(role=Role.SCHEDULER, mode=LaunchMode.DYNAMIC, sched_host="127.0.0.1", sched_port=0,
                        worker_num=1, secret=secret, tls=tls_config)
    sched, _ = start_in_thread(cfg)
    return ("127.0.0.1", sched.port)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2000, help="round trips per setup")
    parser.add_argument("--connects", type=int, default=300, help="connections opened per setup")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="tg-bench-tls-"))
    config = make_test_pki(folder / "pki")
    tls_config = tlsconfig.read({"TG_ENABLE_SSL": "1", "TG_SSL_CONFIG": str(config),
                                 "TG_SERVER_PASSWORD_FILE": str(config.parent / "server.password"),
                                 "TG_CLIENT_PASSWORD_FILE": str(config.parent / "client.password")})
    client_tls = tls.client_context(tls_config)
    addresses = {"open": (scheduler(None), None, None), "secret": (scheduler(SECRET), SECRET, None),
                 "secret+TLS": (scheduler(SECRET, tls_config), SECRET, client_tls)}
    conns = {name: Connection(addr, 5, secret=secret, tls_context=ctx) for name, (addr, secret, ctx) in addresses.items()}
    rtt = {name: [] for name in addresses}
    for _ in range(args.rounds):  # alternating, one round trip each
        for name, conn in random.sample(list(conns.items()), len(conns)):  # in a new order each round
            t = time.perf_counter()
            conn.request(p.Status(), 5)
            rtt[name].append(time.perf_counter() - t)
    setup = {name: [] for name in addresses}
    for _ in range(args.connects):
        for name, (addr, secret, ctx) in random.sample(list(addresses.items()), len(addresses)):
            t = time.perf_counter()
            conn = Connection(addr, 5, secret=secret, tls_context=ctx)
            conn.request(p.Status(), 5)
            setup[name].append(time.perf_counter() - t)
            conn.close()
    names = list(addresses)
    print(f"{'median':<34}" + "".join(f"{n:>12}" for n in names) + "".join(f"{n + ' / open':>18}" for n in names[1:]))
    for label, data in (("round trip on an open connection", rtt), ("connect + handshake + request", setup)):
        med = {n: statistics.median(data[n]) * 1e6 for n in names}
        print(f"{label:<34}" + "".join(f"{med[n]:>9.0f} us" for n in names)
              + "".join(f"{med[n] / med['open']:>18.2f}" for n in names[1:]))


if __name__ == "__main__":
    main()
