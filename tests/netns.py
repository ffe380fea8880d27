"""Hosts for multi-host tests: Linux network namespaces joined by a bridge, made with iproute2.

    switch namespace:  br0 ── va ── vb ── vc            (the "switch"; cutting vc's link partitions C)
    host a:  eth0 10.77.0.1/24     host b: eth0 .2     host c: eth0 .3

Each process runs as `ip netns exec <host> unshare --uts` with the host's own name, so the scheduler,
the agents and gloo (GLOO_SOCKET_IFNAME=eth0) see three machines with three addresses and names.
Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN); `Hosts.unavailable()` says why they cannot be made.

`Hosts(delay_ms=50, loss=0.01)` wires them instead through tests/tapswitch.py, a switch in user space
that delays and drops frames, for kernels without netem (`tc qdisc ... netem` is tried first).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SUBNET = "10.77.0"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


class Hosts:
    made = 0

    def __init__(self, names: tuple[str, ...] = ("a", "b", "c"), *, delay_ms: float = 0.0, loss: float = 0.0):
        self.delay_ms, self.loss = delay_ms, loss
        self.switch_proc: subprocess.Popen | None = None
        Hosts.made += 1
        tag = f"{os.getpid() % 10000}{Hosts.made}"  # fresh names: a deleted namespace's name may linger
        self.names = names
        self.switch = f"tgsw{tag}"
        self.ns = {n: f"tg{n}{tag}" for n in names}
        self.addr = {n: f"{SUBNET}.{i + 1}" for i, n in enumerate(names)}
        self.procs: list[subprocess.Popen] = []

    @staticmethod
    def unavailable() -> str:
        """Why namespaces cannot be made here ("" if they can)."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        probe = f"tgprobe{os.getpid()}"
        try:
            _ip("netns", "add", probe)
            _ip("netns", "del", probe)
            subprocess.run(["unshare", "--uts", "true"], check=True, capture_output=True, timeout=10)
        except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            return f"cannot make a network namespace here: {getattr(exc, 'stderr', '') or exc}"
        return ""

    def up(self) -> "Hosts":
        try:
            return self._up()
        except BaseException:
            self.down()
            raise

    def _up(self) -> "Hosts":
        for n in self.names:
            _ip("netns", "add", self.ns[n])
        if not (self.delay_ms or self.loss):
            self._bridge()
            return self
        try:
            self._bridge()
            self.netem(f"delay {self.delay_ms:g}ms loss {self.loss * 100:g}%")
        except subprocess.CalledProcessError:  # no netem in this kernel: the switch in user space instead
            for n in self.names:  # now: a namespace's deletion frees its devices later, in the background
                subprocess.run(["ip", "-n", self.ns[n], "link", "del", "eth0"], capture_output=True, timeout=20)
            self.down_bridge()
            self._tapswitch()
        return self

    def _bridge(self) -> None:
        """A veth pair from each host's namespace to the switch's bridge."""
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for n in self.names:
            _ip("link", "add", "eth0", "netns", self.ns[n], "type", "veth", "peer", "name", f"v{n}",
                "netns", self.switch)
            _ip("-n", self.ns[n], "addr", "add", f"{self.addr[n]}/24", "dev", "eth0")
            _ip("-n", self.ns[n], "link", "set", "eth0", "up")
            _ip("-n", self.ns[n], "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "set", f"v{n}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"v{n}", "up")

    def down_bridge(self) -> None:
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True, timeout=20)  # its veth ends go too

    def _tapswitch(self) -> None:
        script = Path(__file__).with_name("tapswitch.py")
        self.switch_proc = subprocess.Popen(
            [sys.executable, str(script), "--ns", ",".join(self.ns[n] for n in self.names),
             "--addr", ",".join(self.addr[n] for n in self.names), "--delay-ms", str(self.delay_ms),
             "--loss", str(self.loss)], stdout=subprocess.PIPE, text=True)
        if self.switch_proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"tests/tapswitch.py did not start (exit {self.switch_proc.wait()}; its error is above)")

    def down(self) -> None:
        if self.switch_proc is not None:
            self.switch_proc.kill()
            self.switch_proc.wait(10)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self.down_bridge()

    def partition(self, host: str) -> None:
        """Cut `host` off from every other host (its link to the switch goes down)."""
        _ip("-n", self.switch, "link", "set", f"v{host}", "down")

    def heal(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", f"v{host}", "up")

    def netem(self, spec: str) -> None:
        """`tc qdisc ... netem <spec>` on every host's eth0, e.g. "delay 50ms loss 1%"."""
        for n in self.names:
            subprocess.run(["ip", "netns", "exec", self.ns[n], "tc", "qdisc", "add", "dev", "eth0", "root", "netem",
                            *spec.split()], check=True, capture_output=True, timeout=20)

    def connect_time(self, src: str, dst: str) -> float:
        """Median seconds of a TCP connect from `src` to a listener on `dst`: one round trip on the wire."""
        listen = ("import socket\ns = socket.socket(); s.bind(('0.0.0.0', 5999)); s.listen(); print('up', flush=True)\n"
                  "while True: s.accept()[0].close()")
        server = subprocess.Popen(["ip", "netns", "exec", self.ns[dst], sys.executable, "-c", listen],
                                  stdout=subprocess.PIPE, text=True)
        try:
            server.stdout.readline()
            probe = ("import socket, statistics, time\nts = []\nfor _ in range(5):\n"
                     "    t = time.perf_counter(); socket.create_connection(('%s', 5999), 10).close()\n"
                     "    ts.append(time.perf_counter() - t)\nprint(statistics.median(ts))" % self.addr[dst])
            out = subprocess.run(["ip", "netns", "exec", self.ns[src], sys.executable, "-c", probe],
                                 capture_output=True, text=True, timeout=60, check=True)
            return float(out.stdout)
        finally:
            server.kill()
            server.wait(10)

    def popen(self, host: str, cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """`cmd` on `host`, under the host's name, its output in `log`."""
        wrapped = ["ip", "netns", "exec", self.ns[host], "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                   f"host-{host}", *cmd]
        with open(log, "w") as out:
            proc = subprocess.Popen(wrapped, env={**env, "GLOO_SOCKET_IFNAME": "eth0"}, stdout=out,
                                    stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc
