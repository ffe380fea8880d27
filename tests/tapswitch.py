"""A switch in user space for tests/netns.py where the kernel has no netem: one TAP device per host,
moved into the host's namespace as eth0, and every Ethernet frame a host sends delivered to the others
`--delay-ms` later, each copy lost with probability `--loss`. (A hub: every frame goes to every other
port, and each host's kernel drops what is not its own.) Prints "ready" once the hosts are wired.

    python tests/tapswitch.py --ns NS_A,NS_B,NS_C --addr 10.77.0.1,10.77.0.2,10.77.0.3 --delay-ms 50 --loss 0.01
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import random
import select
import struct
import subprocess
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000


def tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ns", required=True)
    parser.add_argument("--addr", required=True)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--loss", type=float, default=0.0)
    args = parser.parse_args()
    fds = []
    for i, (ns, addr) in enumerate(zip(args.ns.split(","), args.addr.split(","))):
        name = f"tgtap{os.getpid() % 10000}x{i}"
        fds.append(tap(name))
        ip("link", "set", name, "netns", ns)
        ip("-n", ns, "link", "set", name, "name", "eth0")
        ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
    print("ready", flush=True)
    delay, loss, rng = args.delay_ms / 1000, args.loss, random.Random(0)
    queue: collections.deque[tuple[float, int, bytes]] = collections.deque()  # in order: one delay for all
    while True:
        timeout = max(0.0, queue[0][0] - time.monotonic()) if queue else None
        ready, _, _ = select.select(fds, [], [], timeout)
        now = time.monotonic()
        for fd in ready:
            frame = os.read(fd, 65536)
            for out in fds:
                if out != fd and rng.random() >= loss:
                    queue.append((now + delay, out, frame))
        while queue and queue[0][0] <= now:
            _, out, frame = queue.popleft()
            try:
                os.write(out, frame)
            except OSError:  # the host's link is down or gone
                pass


if __name__ == "__main__":
    sys.exit(main())
