"""One worker's Prometheus metrics, per target, served on ``--metrics-port``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# A run takes from milliseconds (a webhook) to an hour (a report).
RUN_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
               300.0, 900.0, 3600.0)


class WorkerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.runs = Counter(
            "hascheduler_worker_runs_total",
            "deliveries by what became of them: succeeded, retrying, dead (an attempt's end),"
            " duplicate, busy, stale (not run), released (given back at shutdown)",
            ["target", "outcome"], registry=r)
        self.run_seconds = Histogram("hascheduler_worker_run_duration_seconds",
                                     "one attempt's handler time", ["target"],
                                     buckets=RUN_SECONDS, registry=r)
        self.running = Gauge("hascheduler_worker_runs_in_flight",
                             "handlers running now", ["target"], registry=r)

    def count(self, target: str, outcome: str) -> None:
        self.runs.labels(target, outcome).inc()

    def duration(self, target: str, seconds: float) -> None:
        self.run_seconds.labels(target).observe(seconds)

    @contextlib.contextmanager
    def in_flight(self, target: str) -> Iterator[None]:
        gauge = self.running.labels(target)
        gauge.inc()
        try:
            yield
        finally:
            gauge.dec()

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, host, registry=self.registry)
