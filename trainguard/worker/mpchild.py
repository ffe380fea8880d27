"""A script's top level run again by multiprocessing, told apart from a process trainguard started.

With the spawn or forkserver start method (a DataLoader's `multiprocessing_context="spawn"`, a `Pool`),
multiprocessing imports the main script again in every child, as `__mp_main__`. A script without an
`if __name__ == "__main__":` guard then calls `trainguard.init()` in each DataLoader worker, which would
register with the scheduler under its parent's node id and be refused after the patience for a dying
predecessor, with a message about a duplicate node id. The same script under plain torch fails as well
(`init_process_group` in every loader worker). Here it fails at once, naming the cause and the fix.
"""

from __future__ import annotations

import sys

from ..errors import ConfigError


def rerun_by_multiprocessing() -> bool:
    """Is this call made from the top level of a script that multiprocessing is importing again (`__mp_main__`)?
    A spawn target function defined in the script is not: it runs after that import ended, so no
    module-level frame of `__mp_main__` is on the stack (torch.multiprocessing.spawn of ranks stays allowed)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back
    return False


def refuse_a_rerun_by_multiprocessing() -> None:
    if rerun_by_multiprocessing():
        raise ConfigError("trainguard.init() was called while multiprocessing ran the script again in a child "
                          "process (a DataLoader worker or a Pool with the spawn or forkserver start method imports "
                          "the main script again, as __mp_main__). Put the script's training code under `if "
                          "__name__ == \"__main__\":`, as multiprocessing requires with spawn")
