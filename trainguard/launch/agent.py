"""The per-host agent behind `trainguard run`.

It starts the workers (and, at node rank 0, the scheduler), waits on each with waitpid in a
thread (so exits are seen at once and in the order they happened), reports each death to
the scheduler at once, restarts in place while the job-wide restart
budget lasts, forwards SIGINT/SIGTERM (workers first, scheduler last) and prefixes every
line a child prints. What to do about an exit is decided by the pure functions below;
`Supervisor` carries the decisions out.
"""

from __future__ import annotations

import contextlib
import enum
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Mapping, Sequence, TextIO

from ..config import (
    ENABLE_RECOVERY_ENV, LOCAL_RANK_ENV, NODE_ID_ENV, RECOVERY_PATH_ENV, ROLE_ENV,
    SCHED_HOST_ENV, SCHED_PORT_ENV, TORCHRUN_LOCAL_RANK, WORKER_NUM_ENV, Role,
)
from ..errors import ConfigError

POLL_INTERVAL_S = 0.02
TAIL_LINES = 40
DEFAULT_GRACE_S = 10.0
DEFAULT_SCHED_EXIT_WAIT_S = 15.0
REPORT_TIMEOUT_S = 1.0  # a report delays the restart; keep it short
PUMP_DRAIN_S = 0.25  # time to read the rest of a dead child's stderr
EXIT_CONFIG = 2  # bad input; a scheduler exiting 2 rejected its config and is not restarted
EXIT_JOB_FAILED = 3  # the scheduler ended the job as failed (root cause on its stderr): not restarted


# --- decisions (pure) ------------------------------------------------------------


class Action(enum.Enum):
    FINISHED = "finished"  # exited 0
    RESTART = "restart"
    GIVE_UP = "give_up"


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str


def decide_exit(role: Role, returncode: int, restarts_used: int, max_restarts: int) -> Decision:
    """What to do when a child exits; `returncode` < 0 means killed by signal -returncode."""
    if returncode == 0:
        return Decision(Action.FINISHED, "exited with code 0")
    if role is Role.SCHEDULER and returncode == EXIT_CONFIG:
        return Decision(Action.GIVE_UP, "the scheduler rejected its configuration; a restart cannot help")
    if role is Role.SCHEDULER and returncode == EXIT_JOB_FAILED:
        return Decision(Action.GIVE_UP, "the scheduler ended the job as failed")
    if restarts_used < max_restarts:
        return Decision(Action.RESTART, f"restart {restarts_used + 1}/{max_restarts}")
    if max_restarts == 0:
        return Decision(Action.GIVE_UP, "restarts are off (--max-restarts 0)")
    return Decision(Action.GIVE_UP, f"all {max_restarts} restarts are used")


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(name: str, pid: int, returncode: int) -> str:
    if returncode < 0:
        return f"{name} (pid {pid}) was killed by signal {signal_name(-returncode)}"
    return f"{name} (pid {pid}) exited with code {returncode}"


def exit_code_for(returncode: int) -> int:
    """The agent's exit code for a failed job: the child's own code if > 0, else 1."""
    return returncode if returncode > 0 else 1


def signal_exit_code(signum: int) -> int:
    return 128 + signum


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed child: the first one is the job's root cause."""

    name: str
    pid: int
    returncode: int
    tail: tuple[str, ...] = ()
    role: Role = Role.WORKER

    def describe(self) -> str:
        return describe_exit(self.name, self.pid, self.returncode)


def failure_summary(root: Failure, restarts_used: int) -> str:
    """The one message printed when the job fails for good."""
    if root.role is Role.SCHEDULER and root.returncode == EXIT_JOB_FAILED:
        head = f"trainguard: the scheduler (pid {root.pid}) ended the job as failed; its last lines give the root cause"
    elif restarts_used:
        plural = "restart" if restarts_used == 1 else "restarts"
        head = f"trainguard: giving up after {restarts_used} {plural}; root cause: {root.describe()}"
    else:
        head = f"trainguard: {root.describe()}"
    if not root.tail:
        return head
    return "\n".join([head, f"last stderr lines of {root.name}:", *("    " + ln for ln in root.tail)])


# --- what the children are started with -------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSpec:
    """One agent's job description, validated; errors name the flag."""

    script: str
    script_args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    sched_host: str = "127.0.0.1"
    sched_port: int = 0  # 0 = not chosen yet (the CLI picks a free one)
    max_restarts: int = 3
    recovery_path: Path | None = None
    log_dir: Path | None = None
    grace_s: float = DEFAULT_GRACE_S
    sched_exit_wait_s: float = DEFAULT_SCHED_EXIT_WAIT_S

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ConfigError(f"--workers/--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), got {self.node_rank}")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if not 0 <= self.sched_port <= 65535:
            raise ConfigError(f"--sched-port must be in 1..65535, got {self.sched_port}")
        if self.grace_s <= 0 or self.sched_exit_wait_s < 0:
            raise ConfigError("the grace period must be > 0 and the scheduler exit wait >= 0 seconds")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def enable_recovery(self) -> bool:
        return self.max_restarts > 0

    @property
    def hosts_scheduler(self) -> bool:
        return self.node_rank == 0


def set_env(env: dict[str, str], names: str | tuple[str, ...], value: str | None) -> None:
    """Set the first name (or remove it if value is None) and drop its aliases, so they cannot conflict."""
    names = (names,) if isinstance(names, str) else names
    for alias in names[1:]:
        env.pop(alias, None)
    if value is None:
        env.pop(names[0], None)
    else:
        env[names[0]] = value


def _cluster_env(base: Mapping[str, str], spec: LaunchSpec, role: Role) -> dict[str, str]:
    env = dict(base)
    set_env(env, ROLE_ENV, role.value)
    set_env(env, SCHED_HOST_ENV, spec.sched_host)
    set_env(env, SCHED_PORT_ENV, str(spec.sched_port))
    set_env(env, WORKER_NUM_ENV, str(spec.world_size))
    set_env(env, ENABLE_RECOVERY_ENV, "1" if spec.enable_recovery else "0")
    set_env(env, RECOVERY_PATH_ENV, str(spec.recovery_path) if spec.recovery_path else None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def scheduler_env(base: Mapping[str, str], spec: LaunchSpec) -> dict[str, str]:
    env = _cluster_env(base, spec, Role.SCHEDULER)
    set_env(env, NODE_ID_ENV, None)
    set_env(env, LOCAL_RANK_ENV, None)
    return env


def worker_env(base: Mapping[str, str], spec: LaunchSpec, index: int) -> dict[str, str]:
    env = _cluster_env(base, spec, Role.WORKER)
    set_env(env, NODE_ID_ENV, str(spec.node_rank * spec.nproc_per_node + index))
    set_env(env, LOCAL_RANK_ENV, str(index))
    env[TORCHRUN_LOCAL_RANK] = str(index)  # for scripts that pick their device torchrun's way
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


# --- the children ------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class Child:
    role: Role
    index: int  # local index on this host (0 for the scheduler)
    node_id: str | None
    cmd: list[str]
    env: dict[str, str]
    popen: subprocess.Popen | None = None
    restarts: int = 0
    done: bool = False  # exited 0: never polled again
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    pumps: list[threading.Thread] = field(default_factory=list)
    log: IO[str] | None = None

    @property
    def name(self) -> str:
        return "scheduler" if self.role is Role.SCHEDULER else f"worker {self.node_id}"

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


def _pump(stream: IO[bytes], prefix: str, sink: TextIO, lock: threading.Lock,
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


# --- the supervisor ----------------------------------------------------------------


class Supervisor:
    """Runs one host's children until the job ends; `run()` returns the agent's exit code."""

    def __init__(self, spec: LaunchSpec, *, scheduler_cmd: Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None,
                 out: TextIO | None = None, err: TextIO | None = None) -> None:
        if spec.sched_port == 0:
            raise ConfigError("the scheduler port is not chosen; give --sched-port or let the CLI pick one")
        if spec.enable_recovery and spec.recovery_path is None:
            raise ConfigError("recovery is on (--max-restarts > 0) but no recovery path is set; give --recovery-path")
        self.spec = spec
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        base = os.environ if env is None else env
        self.children: list[Child] = []
        if spec.hosts_scheduler:
            cmd = list(scheduler_cmd or [sys.executable, "-m", "trainguard", "scheduler"])
            self.children.append(Child(Role.SCHEDULER, 0, None, cmd, scheduler_env(base, spec)))
        for i in range(spec.nproc_per_node):
            self.children.append(Child(
                Role.WORKER, i, str(spec.node_rank * spec.nproc_per_node + i),
                [sys.executable, "-u", spec.script, *spec.script_args], worker_env(base, spec, i)))
        self.restarts_used = 0
        self.root: Failure | None = None
        self._signals: list[int] = []
        self._lock = threading.Lock()
        self._can_report = True
        self._exits: queue.Queue[tuple[Child, subprocess.Popen, int]] = queue.Queue()

    @property
    def workers(self) -> list[Child]:
        return [c for c in self.children if c.role is Role.WORKER]

    @property
    def scheduler(self) -> Child | None:
        return next((c for c in self.children if c.role is Role.SCHEDULER), None)

    def run(self) -> int:
        previous = self._install_signal_handlers()
        try:
            where = f"{self.spec.sched_host}:{self.spec.sched_port}"
            self._say(f"{'starting' if self.spec.hosts_scheduler else 'using'} scheduler at {where}; "
                      f"{self.spec.nproc_per_node} worker{'s' * (self.spec.nproc_per_node != 1)} on node rank {self.spec.node_rank} of {self.spec.nnodes}; "
                      f"max restarts {self.spec.max_restarts}; recovery path {self.spec.recovery_path}")
            if self.spec.log_dir is not None:
                self.spec.log_dir.mkdir(parents=True, exist_ok=True)
            for child in self.children:  # the scheduler first
                self._start(child)
            return self._loop()
        finally:
            self._kill(self.children)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for child in self.children:
                if child.log is not None:
                    child.log.close()

    # --- the loop --------------------------------------------------------------------

    def _loop(self) -> int:
        while True:
            if self._signals:
                signum = self._signals[0]
                self._say(f"received {signal_name(signum)}; forwarding it to the workers, then the scheduler")
                self._stop(signum)
                return signal_exit_code(signum)
            try:
                child, popen, rc = self._exits.get(timeout=POLL_INTERVAL_S)
            except queue.Empty:
                continue
            if popen is not child.popen:
                continue  # an incarnation already replaced
            code = self._on_exit(child, rc)
            if code is not None:
                return code
            if all(w.done for w in self.workers):
                self._finish()
                return 0

    def _on_exit(self, child: Child, rc: int) -> int | None:
        """Carry out the decision for one exit; return the agent's exit code if the job is over."""
        decision = decide_exit(child.role, rc, self.restarts_used, self.spec.max_restarts)
        if decision.action is Action.FINISHED:
            child.done = True
            return None
        assert child.popen is not None
        for pump in child.pumps:
            pump.join(PUMP_DRAIN_S)
        with self._lock:
            failure = Failure(child.name, child.popen.pid, rc, tuple(child.tail), child.role)
        self.root = self.root or failure
        self._say(failure.describe())
        if child.role is Role.WORKER:
            self._report(child, failure)
        if decision.action is Action.RESTART:
            self.restarts_used += 1
            child.restarts += 1
            self._say(f"restarting {child.name} (restart {self.restarts_used}/{self.spec.max_restarts})")
            self._kill([child])  # leftovers of the dead process's group
            self._start(child)
            return None
        self._say(f"stopping the job: {decision.reason}")
        self._stop(signal.SIGTERM)
        print(failure_summary(self.root, self.restarts_used), file=self.err, flush=True)
        return exit_code_for(self.root.returncode)

    def _finish(self) -> None:
        """Every worker exited 0: let the scheduler exit by itself, then stop it."""
        sched = self.scheduler
        if sched is None or not sched.alive():
            return
        deadline = time.monotonic() + self.spec.sched_exit_wait_s
        while sched.alive() and time.monotonic() < deadline and not self._signals:
            time.sleep(POLL_INTERVAL_S)
        if sched.alive():
            self._say("all workers finished; stopping the scheduler")
            self._signal([sched], signal.SIGTERM)
            self._wait([sched], time.monotonic() + self.spec.grace_s)

    # --- processes -------------------------------------------------------------------

    def _start(self, child: Child) -> None:
        if self.spec.log_dir is not None and child.log is None:
            stem = "scheduler" if child.role is Role.SCHEDULER else f"worker_{child.node_id}"
            child.log = open(self.spec.log_dir / f"{stem}.log", "a", encoding="utf-8")
        child.popen = subprocess.Popen(child.cmd, env=child.env, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       start_new_session=True)  # signals reach it only via the agent
        child.done = False
        with self._lock:
            child.tail.clear()
        prefix = f"[{child.name}] "
        child.pumps = [
            threading.Thread(target=_pump, args=(child.popen.stdout, prefix, self.out, self._lock, None, child.log),
                             name=f"tg-{child.name}-out", daemon=True),
            threading.Thread(target=_pump, args=(child.popen.stderr, prefix, self.err, self._lock, child.tail,
                                                 child.log), name=f"tg-{child.name}-err", daemon=True),
        ]
        for pump in child.pumps:
            pump.start()
        threading.Thread(target=self._await_exit, args=(child, child.popen), name=f"tg-{child.name}-wait",
                         daemon=True).start()

    def _await_exit(self, child: Child, popen: subprocess.Popen) -> None:
        self._exits.put((child, popen, popen.wait()))

    def _stop(self, signum: int) -> None:
        """Signal the workers, wait for them, then the scheduler; SIGKILL what outlives the grace period."""
        deadline = time.monotonic() + self.spec.grace_s
        self._signal(self.workers, signum)
        self._wait(self.workers, deadline)
        sched = [c for c in self.children if c.role is Role.SCHEDULER]
        self._signal(sched, signum)
        self._wait(sched, max(deadline, time.monotonic() + 1.0))
        self._kill(self.children)

    def _signal(self, children: Sequence[Child], signum: int) -> None:
        for child in children:
            if child.alive():
                assert child.popen is not None
                child.popen.send_signal(signum)

    def _wait(self, children: Sequence[Child], deadline: float) -> None:
        """Wait until the children exit, the deadline passes, or a second signal asks to hurry."""
        hurry = len(self._signals) + 1
        while any(c.alive() for c in children) and time.monotonic() < deadline:
            if len(self._signals) > hurry:
                return
            time.sleep(POLL_INTERVAL_S)

    def _kill(self, children: Sequence[Child]) -> None:
        """SIGKILL each child's whole process group (it has its own session), then reap it.

        Children that finished (exit 0) are skipped: their group id may long since name another process.
        """
        for child in children:
            if child.popen is None or child.done:
                continue
            with contextlib.suppress(ProcessLookupError):  # an empty group: nothing left to clean up
                os.killpg(child.popen.pid, signal.SIGKILL)
            try:
                child.popen.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._say(f"{child.name} (pid {child.popen.pid}) survives SIGKILL (stuck in the kernel?)")
            for pump in child.pumps:
                pump.join(PUMP_DRAIN_S)

    # --- reporting -------------------------------------------------------------------

    def _report(self, child: Child, failure: Failure) -> None:
        """Tell the scheduler about a dead worker right away (best effort)."""
        sched = self.scheduler
        if not self._can_report or (sched is not None and not sched.alive()):
            return
        try:
            from ..cluster.client import report_exit
        except ImportError as exc:
            self._can_report = False
            self._say(f"cannot report exits to the scheduler ({exc}); it will see them by heartbeat")
            return
        rc = failure.returncode
        code, sig = (None, -rc) if rc < 0 else (rc, None)
        address = (self.spec.sched_host, self.spec.sched_port)
        try:
            ok = report_exit(address, child.node_id or "", failure.pid, code, sig,
                             "\n".join(failure.tail), timeout=REPORT_TIMEOUT_S)
        except Exception as exc:  # a failed report must never block the restart
            self._say(f"reporting the exit of {child.name} failed: {exc!r}")
            return
        if not ok:
            self._say(f"scheduler at {address[0]}:{address[1]} did not take the exit report of {child.name}")

    def _say(self, message: str) -> None:
        with self._lock:
            print(f"[agent] {message}", file=self.err, flush=True)

    def _install_signal_handlers(self) -> dict[int, object]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, _frame: self._signals.append(signum))
        return previous


def launch(spec: LaunchSpec, **kwargs: object) -> int:
    """Run one host's share of the job; returns the agent's exit code."""
    return Supervisor(spec, **kwargs).run()  # type: ignore[arg-type]
