"""Fault injection and replica checks for chaos-testing trainguard jobs (yours too)."""

from ..train.engine.faults import Fault, FaultInjector, fail_at, faults_from_env
from .consistency import ReplicaCheck, ReplicasDiverged, parameter_digest

__all__ = ["Fault", "FaultInjector", "ReplicaCheck", "ReplicasDiverged", "fail_at", "faults_from_env",
           "parameter_digest"]
