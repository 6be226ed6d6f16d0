"""One worker's Prometheus metrics, per target, served on ``--metrics-port``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# A run takes from milliseconds (a webhook) to an hour (a report).
RUN_SECONDS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    3600.0,
)


class WorkerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.runs = Counter(
            "hascheduler_worker_runs_total",
            "deliveries by what became of them: succeeded, retrying, dead (an attempt's end),"
            " duplicate, busy, stale (not run), released (given back at shutdown)",
            ["target", "outcome"],
            registry=r,
        )
        self.run_seconds = Histogram(
            "hascheduler_worker_run_duration_seconds",
            "one attempt's handler time",
            ["target"],
            buckets=RUN_SECONDS,
            registry=r,
        )
        self.running = Gauge(
            "hascheduler_worker_runs_in_flight", "handlers running now", ["target"], registry=r
        )

        # Label lookups cost as much as the rest of a no-op run: keep the children.
        self._counts: dict[tuple[str, str], Any] = {}
        self._durations: dict[str, Any] = {}
        self._running: dict[str, Any] = {}

    def count(self, target: str, outcome: str) -> None:
        child = self._counts.get((target, outcome))
        if child is None:
            child = self._counts[target, outcome] = self.runs.labels(target, outcome)
        child.inc()

    def duration(self, target: str, seconds: float) -> None:
        child = self._durations.get(target)
        if child is None:
            child = self._durations[target] = self.run_seconds.labels(target)
        child.observe(seconds)

    @contextlib.contextmanager
    def in_flight(self, target: str) -> Iterator[None]:
        gauge = self._running.get(target)
        if gauge is None:
            gauge = self._running[target] = self.running.labels(target)
        gauge.inc()
        try:
            yield
        finally:
            gauge.dec()

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, host, registry=self.registry)
