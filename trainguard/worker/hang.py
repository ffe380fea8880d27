"""A worker the scheduler judged hung (control/waits.py) prints every thread's stack, then ends as a dead worker.

It is asked in its heartbeat's reply, so it runs on the heartbeat thread, beside the stuck one. The stacks go
to stderr, which `trainguard run` prefixes with the worker's name and keeps in its log. Then SIGKILL: a thread
stuck in C (a deadlocked loader, a filesystem that stopped answering) cannot be unwound, and the process is
replaced as any dead worker is, back to the last commit.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys


def die_hung(why: str) -> None:
    print(f"trainguard: this worker is hung: {why}; its threads' stacks follow, then it is killed and replaced",
          file=sys.stderr, flush=True)
    try:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
    finally:
        os.kill(os.getpid(), signal.SIGKILL)
