"""Fault injection and replica checks for chaos-testing trainguard jobs (yours too)."""

from .consistency import ReplicaCheck, ReplicasDiverged, parameter_digest
from ..train.faults import Fault, FaultInjector, fail_at, faults_from_env

__all__ = ["Fault", "FaultInjector", "ReplicaCheck", "ReplicasDiverged", "fail_at", "faults_from_env",
           "parameter_digest"]
