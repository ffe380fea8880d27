"""The per-host agent behind `trainguard run`.

It starts the workers (and, at node rank 0, the scheduler), waits on each with waitpid in a
thread (so exits are seen at once and in the order they happened), reports each death to
the scheduler at once, restarts in place while the job-wide restart
budget lasts (and the recover strategy replaces dead workers), forwards SIGINT/SIGTERM/SIGUSR1
(workers first, scheduler last; the workers then save a dying-gasp checkpoint within the grace
period and exit 75, and so does the agent) and prefixes every line a child prints. A restarted worker is, when one is warm, a hot spare that already
imported torch (spares.py) rather than a fresh process. What to do about an exit is decided
by the pure functions in policy.py; `Supervisor` carries the decisions out.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Mapping, Sequence, TextIO

from ..config import Role
from ..errors import ConfigError
from ..obs.events import EventLog, format_recovery, summarize_recovery
from .policy import (
    Action, Failure, LaunchSpec, decide_exit, ended_exit, exit_code_for, failure_summary, scheduler_env,
    signal_name, signalled_exit, spare_env, worker_env,
)
from .spares import SparePool, activate

POLL_INTERVAL_S = 0.02
TAIL_LINES = 40
REPORT_TIMEOUT_S = 1.0  # a report delays the restart; keep it short
PUMP_DRAIN_S = 0.25  # time to read the rest of a dead child's stderr


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
        self.spares: SparePool | None = None
        if spec.uses_hot_spares:
            self.spares = SparePool(spec.script, spare_env(base, spec), spec.hot_spares, say=self._say)
        self.restarts_used = 0
        self.root: Failure | None = None
        self.preempted = False  # a worker exited 75: the job is stopping gracefully, nothing is restarted
        self.fault_stops: list[Failure] = []  # workers that left (76) because the job stops after a fault
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
            spec = self.spec
            spares = spec.hot_spares if self.spares else 0
            self._say(f"{'starting' if spec.hosts_scheduler else 'using'} scheduler at {spec.sched_host}:{spec.sched_port}; "
                      f"{spec.nproc_per_node} worker{'s' * (spec.nproc_per_node != 1)} on node rank {spec.node_rank} of {spec.nnodes}; "
                      f"max restarts {spec.max_restarts}; {spares} hot spare{'s' * (spares != 1)}; "
                      f"recover strategy {spec.recover_strategy}; grace period {spec.grace_s:g} s; "
                      f"recovery path {spec.recovery_path}")
            if spec.log_dir is not None:
                spec.log_dir.mkdir(parents=True, exist_ok=True)
            for child in self.children:  # the scheduler first
                self._start(child)
            if self.spares is not None:  # after the workers: they need the CPU first
                self.spares.start()
            code = self._loop()
            self._print_recoveries()
            return code
        finally:
            self._close_spares()
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
                return self._signalled_code(signum)
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
                return self._final_code()

    def _final_code(self) -> int:
        code, message = ended_exit(self.preempted, self.fault_stops, self.root, self.restarts_used)
        if message:
            print(message, file=self.err, flush=True)
        return code

    def _signalled_code(self, signum: int) -> int:
        code, message = signalled_exit([w.popen.returncode for w in self.workers if w.popen is not None], signum)
        if message:
            print(message, file=self.err, flush=True)
        return code

    def _on_exit(self, child: Child, rc: int) -> int | None:
        """Carry out the decision for one exit; return the agent's exit code if the job is over."""
        decision = decide_exit(child.role, rc, self.restarts_used, self.spec.max_restarts, self.spec.recover_strategy,
                               stopping=self.preempted)
        if decision.action is Action.FINISHED:
            child.done = True
            return None
        assert child.popen is not None
        for pump in child.pumps:
            pump.join(PUMP_DRAIN_S)
        with self._lock:
            failure = Failure(child.name, child.popen.pid, rc, tuple(child.tail), child.role)
        if decision.action in (Action.PREEMPTED, Action.STOPPED):  # it left on purpose: no restart, no report
            child.done = True
            self.preempted = self.preempted or decision.action is Action.PREEMPTED
            if decision.action is Action.STOPPED:
                self.fault_stops.append(failure)
            self._say(f"{failure.describe()}: {decision.reason}")
            return None
        self.root = self.root or failure
        self._say(failure.describe())
        if child.role is Role.WORKER:
            self._report(child, failure, final=decision.action is Action.GIVE_UP)
        if decision.action is Action.RESTART:
            self.restarts_used += 1
            child.restarts += 1
            self._kill([child])  # leftovers of the dead process's group
            self._restart(child)
            return None
        self._say(f"stopping the job: {decision.reason}")
        self._stop(signal.SIGTERM)
        print(failure_summary(self.root, self.restarts_used, failure, self.spec.max_restarts), file=self.err,
              flush=True)
        return exit_code_for(self.root.returncode)

    def _finish(self) -> None:
        """Every worker exited 0: let the scheduler exit by itself, then stop it."""
        self._close_spares()
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
        """A fresh process for the child."""
        popen = subprocess.Popen(child.cmd, env=child.env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True)  # signals reach it only via the agent
        self._attach(child, popen)

    def _restart(self, child: Child) -> None:
        """A worker from a hot spare when one is alive, else (and always for the scheduler) a fresh process."""
        budget = f"restart {self.restarts_used}/{self.spec.max_restarts}"
        more = self.restarts_used < self.spec.max_restarts  # else no restart will need a successor
        spare = self.spares.take(replace=more) if self.spares and child.role is Role.WORKER else None
        if not more:
            self._close_spares()
        if spare is not None:
            try:
                activate(spare, child.env, self.spec.script_args)
            except OSError as exc:
                self._say(f"the hot spare (pid {spare.pid}) could not take over ({exc}); starting a fresh process")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(spare.pid, signal.SIGKILL)
                spare.wait()
            else:
                self._say(f"restarting {child.name} from a hot spare ({budget})")
                self._attach(child, spare)
                return
        self._say(f"restarting {child.name} ({budget})")
        self._start(child)

    def _attach(self, child: Child, popen: subprocess.Popen) -> None:
        """Make `popen` the child's process: prefix pumps, tail, log file, exit watcher."""
        if self.spec.log_dir is not None and child.log is None:
            stem = "scheduler" if child.role is Role.SCHEDULER else f"worker_{child.node_id}"
            child.log = open(self.spec.log_dir / f"{stem}.log", "a", encoding="utf-8")
        child.popen = popen
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

    def _close_spares(self) -> None:
        if self.spares is not None:
            self.spares.close()

    def _stop(self, signum: int) -> None:
        """Signal the workers, wait for them, then the scheduler; SIGKILL what outlives the grace period."""
        self._close_spares()
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

    def _report(self, child: Child, failure: Failure, *, final: bool = False) -> None:
        """Tell the scheduler about a dead worker right away (best effort); `final`: it is not replaced,
        so the scheduler ends the job with this root cause and the survivors leave."""
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
                             "\n".join(failure.tail), timeout=REPORT_TIMEOUT_S, final=final)
        except Exception as exc:  # a failed report must never block the restart
            self._say(f"reporting the exit of {child.name} failed: {exc!r}")
            return
        if not ok:
            self._say(f"scheduler at {address[0]}:{address[1]} did not take the exit report of {child.name}")

    def _print_recoveries(self) -> None:
        """One line per recovery of this job, with its MTTR and lost steps (from events.jsonl)."""
        path = self.spec.recovery_path / "events.jsonl" if self.spec.recovery_path else None
        if path is None or not path.is_file() or not self.spec.hosts_scheduler:
            return
        for i, rec in enumerate(summarize_recovery(EventLog.read(path)), 1):
            print(format_recovery(i, rec), file=self.out, flush=True)

    def _say(self, message: str) -> None:
        with self._lock:
            print(f"[agent] {message}", file=self.err, flush=True)

    def _install_signal_handlers(self) -> dict[int, object]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            previous[sig] = signal.signal(sig, lambda signum, _frame: self._signals.append(signum))
        return previous


def launch(spec: LaunchSpec, **kwargs: object) -> int:
    """Run one host's share of the job; returns the agent's exit code."""
    return Supervisor(spec, **kwargs).run()  # type: ignore[arg-type]
