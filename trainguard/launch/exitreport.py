"""An agent tells the scheduler that one of its workers died, right away and best effort: the report
starts the recovery before heartbeats would, and a failed report never holds up the restart."""

from __future__ import annotations

from typing import Callable

from ..control.client import report_exit
from ..errors import TrainguardError
from .children import Child
from .policy import Failure, LaunchSpec

REPORT_TIMEOUT_S = 1.0  # a report delays the restart; keep it short
JOB_ENDED = "the job had ended (the scheduler exited 0)"


def report_death(spec: LaunchSpec, sched: Child | None, child: Child, failure: Failure, say: Callable[[str], None],
                 *, final: bool = False, why: str = "") -> str:
    """Report `child`'s death; `final`: it is not replaced, so the scheduler ends the job with this root cause
    and the survivors leave. Returns why the worker needs no replacement (it had finished, or the job is
    over), else ""."""
    if sched is not None and sched.done:
        return JOB_ENDED
    if sched is not None and not sched.alive():
        return ""
    rc = failure.returncode
    code, sig = (None, -rc) if rc < 0 else (rc, None)
    address = (spec.sched_host, spec.sched_port)
    try:
        ok, over = report_exit(address, child.node_id or "", failure.pid, code, sig,
                               "\n".join(([why] if why else []) + list(failure.tail))[-16000:],
                               timeout=REPORT_TIMEOUT_S, final=final, secret=spec.secret)
    except (OSError, TrainguardError) as exc:  # a failed report must never block the restart
        say(f"reporting the exit of {child.name} failed: {exc!r}")
        return ""
    if not ok:
        say(f"scheduler at {address[0]}:{address[1]} did not take the exit report of {child.name}")
        if sched is not None and sched.popen is not None and sched.popen.poll() == 0:
            return JOB_ENDED  # it was leaving as the worker died
    return over
