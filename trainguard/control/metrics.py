"""Prometheus metrics from the scheduler: `trainguard run --metrics-port P` (TG_METRICS_PORT; off by
default) serves them at http://HOST:P/metrics, HOST being TG_METRICS_HOST, else the scheduler's own
address.

The values come from the JobView snapshot (status.py) that the scheduler's event loop publishes before
the endpoint listens, then once a second; prometheus_client's HTTP thread only reads that dict, never the
scheduler's live state. The endpoint serves metrics and nothing else: no secret, host name, pid or path
appears in them, and the only label values are worker states, phases, causes, the recover strategy and
agent numbers.

| metric                               | type      | labels           |
|--------------------------------------|-----------|------------------|
| trainguard_generation                | gauge     |                  |
| trainguard_job_running               | gauge     |                  |
| trainguard_workers                   | gauge     | state            |
| trainguard_recoveries_total          | counter   | strategy, cause  |
| trainguard_recovery_seconds          | histogram | phase (and total) |
| trainguard_steps_total               | counter   | (steps redone after a recovery count again) |
| trainguard_step                      | gauge     | (the committed step) |
| trainguard_step_seconds              | gauge     | (mean over the last 30 s) |
| trainguard_checkpoint_seconds        | histogram |                  |
| trainguard_checkpoint_bytes_total    | counter   |                  |
| trainguard_hot_spares_ready          | gauge     | agent            |
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable

from ..errors import ConfigError
from ..obs.timeline import PHASES
from . import membership as m

log = logging.getLogger("trainguard.metrics")

SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def _histogram(family, labels: list[str], values: list[float], buckets=SECONDS_BUCKETS) -> None:
    cumulative = [(str(b), sum(1 for v in values if v <= b)) for b in buckets]
    family.add_metric(labels, cumulative + [("+Inf", len(values))], sum(values))


def families(snap: dict[str, Any]) -> list:
    """The metric families of one status snapshot (pure but for prometheus_client's types)."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    out = []
    if not snap:
        return out
    out.append(GaugeMetricFamily("trainguard_generation", "The current generation (process group incarnation).",
                                 value=snap["generation"]))
    out.append(GaugeMetricFamily("trainguard_job_running", "1 while the job runs, 0 once it ended.",
                                 value=1 if snap["job"] == m.JobState.RUNNING.value else 0))
    workers = GaugeMetricFamily("trainguard_workers", "Members by state.", labels=["state"])
    counts = Counter(n["state"] for n in snap["nodes"])
    for state in m.NodeState:
        workers.add_metric([state.value], counts.get(state.value, 0))
    out.append(workers)
    recoveries = CounterMetricFamily("trainguard_recoveries_total", "Recoveries since the job started.",
                                     labels=["strategy", "cause"])
    for cause, n in sorted(Counter(r["cause"] for r in snap["recoveries"]).items()):
        recoveries.add_metric([snap["strategy"], cause], n)
    out.append(recoveries)
    seconds = HistogramMetricFamily("trainguard_recovery_seconds", "Duration of each phase of each completed "
                                    "recovery, and of the whole (phase=total).", labels=["phase"])
    for phase in PHASES:
        _histogram(seconds, [phase], [r["phases"][phase] for r in snap["recoveries"] if phase in r["phases"]])
    _histogram(seconds, ["total"], [r["total_s"] for r in snap["recoveries"] if r["total_s"] is not None])
    out.append(seconds)
    out.append(CounterMetricFamily("trainguard_steps", "Training steps finished (steps redone after a recovery "
                                   "count again).", value=snap["steps_done"]))
    out.append(GaugeMetricFamily("trainguard_step", "The job's committed step.", value=snap["step"] or 0))
    rate = snap["step_rate"]
    out.append(GaugeMetricFamily("trainguard_step_seconds", "Mean seconds per step over the last 30 s (0: no "
                                 "progress).", value=1 / rate if rate else 0.0))
    ckpt = HistogramMetricFamily("trainguard_checkpoint_seconds", "Time from capture to commit of each checkpoint.")
    _histogram(ckpt, [], [s for s, _ in snap["checkpoints"]])
    out.append(ckpt)
    out.append(CounterMetricFamily("trainguard_checkpoint_bytes", "Bytes of checkpoints written.",
                                   value=sum(b for _, b in snap["checkpoints"])))
    spares = GaugeMetricFamily("trainguard_hot_spares_ready", "Warm hot spares per agent.", labels=["agent"])
    for agent, ready in snap["spares"].items():
        spares.add_metric([str(agent)], ready)
    out.append(spares)
    return out


class _Collector:
    def __init__(self, snapshot: Callable[[], dict]):
        self.snapshot = snapshot

    def collect(self):
        return families(self.snapshot())


class MetricsServer:
    """The HTTP endpoint, on its own thread; `close()` stops it."""

    def __init__(self, host: str, port: int, snapshot: Callable[[], dict]):
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError:
            raise ConfigError("TG_METRICS_PORT needs prometheus_client: pip install prometheus_client") from None
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(snapshot))
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise ConfigError(f"the metrics endpoint cannot listen on {host}:{port} ({exc.strerror or exc}); free the "
                              "port or choose another with --metrics-port (TG_METRICS_PORT)") from None
        self.port = self.server.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
