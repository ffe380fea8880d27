"""What the agent supervises: one child process (scheduler or worker), and the pumps that copy
its output, line by line and prefixed with its name, to the agent's own output and log."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Callable, Sequence, TextIO

from ..config import Role

TAIL_LINES = 40


@dataclass(slots=True, eq=False)
class Child:
    role: Role
    index: int  # local index on this host (0 for the scheduler)
    node_id: str | None
    cmd: list[str]
    env: dict[str, str]
    popen: subprocess.Popen | None = None
    restarts: int = 0
    restart_times: list[float] = field(default_factory=list)  # monotonic; for the crash-loop rate (budget.py)
    done: bool = False  # exited 0 (or moved to another host): never polled again
    placing: bool = False  # recover: dead, its new host not yet decided (not reported as running here)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    pumps: list[threading.Thread] = field(default_factory=list)
    log: IO[str] | None = None

    @property
    def name(self) -> str:
        return "scheduler" if self.role is Role.SCHEDULER else f"worker {self.node_id}"

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start_pumps(self, out: TextIO, err: TextIO, lock: threading.Lock) -> None:
        """Copy the process's stdout to `out` and stderr to `err` (and to its tail), prefixed with its name."""
        assert self.popen is not None
        prefix = f"[{self.name}] "
        self.pumps = [
            threading.Thread(target=pump_lines, args=(self.popen.stdout, prefix, out, lock, None, self.log),
                             name=f"tg-{self.name}-out", daemon=True),
            threading.Thread(target=pump_lines, args=(self.popen.stderr, prefix, err, lock, self.tail, self.log),
                             name=f"tg-{self.name}-err", daemon=True),
        ]
        for pump in self.pumps:
            pump.start()

    def kill_group(self, drain_s: float) -> str:
        """SIGKILL the child's whole process group (it has its own session) and reap it; "" or what went wrong.
        A child that finished (exit 0) is skipped: its group id may long since name another process."""
        if self.popen is None or self.done:
            return ""
        with contextlib.suppress(ProcessLookupError):  # an empty group: nothing left to clean up
            os.killpg(self.popen.pid, signal.SIGKILL)
        problem = ""
        try:
            self.popen.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            problem = f"{self.name} (pid {self.popen.pid}) survives SIGKILL (stuck in the kernel?)"
        for pump in self.pumps:
            pump.join(drain_s)
        return problem


def signal_alive(children: Sequence[Child], signum: int) -> None:
    for child in children:
        if child.alive():
            assert child.popen is not None
            child.popen.send_signal(signum)


def wait_exits(children: Sequence[Child], deadline: float, hurry: Callable[[], bool], poll: float) -> None:
    """Until every child exited, `deadline` (monotonic) passed, or `hurry()` says to stop waiting."""
    while any(c.alive() for c in children) and time.monotonic() < deadline and not hurry():
        time.sleep(poll)


def pump_lines(stream: IO[bytes], prefix: str, sink: TextIO, lock: threading.Lock,
          tail: deque[str] | None, log: IO[str] | None) -> None:
    """Copy a child's pipe line by line to `sink` with a prefix (and to its log file)."""
    broken = False
    with stream:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            with lock:
                if tail is not None:
                    tail.append(line)
                try:
                    if log is not None:
                        log.write(line + "\n")
                        log.flush()
                    if not broken:
                        sink.write(f"{prefix}{line}\n")
                        sink.flush()
                except (OSError, ValueError) as exc:  # closed terminal or pipe: keep draining the child
                    if not broken:
                        broken = True
                        print(f"[agent] cannot copy output of {prefix.strip()}: {exc}", file=sys.__stderr__)
