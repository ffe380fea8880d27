"""Fault injection for chaos-testing trainguard jobs (yours too)."""

from .faults import Fault, FaultInjector, fail_at, faults_from_env

__all__ = ["Fault", "FaultInjector", "fail_at", "faults_from_env"]
