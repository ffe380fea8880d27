"""Launching: the per-host agent (`trainguard run`) and the command line.

Names load lazily: every worker starts as `python -m trainguard.launch.worker_main`, which must not
pay for the agent, the CLI and pydantic.
"""

from __future__ import annotations

import importlib

_LAZY = {"Child": "agent", "LaunchSpec": "agent", "Supervisor": "agent", "launch": "agent", "main": "cli"}

__all__ = ["Child", "LaunchSpec", "Supervisor", "launch", "main"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'trainguard.launch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
