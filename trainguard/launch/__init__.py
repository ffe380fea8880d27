"""Launching: the per-host agent (`trainguard run`) and the command line."""

from .agent import Child, LaunchSpec, Supervisor, launch
from .cli import main

__all__ = ["Child", "LaunchSpec", "Supervisor", "launch", "main"]
