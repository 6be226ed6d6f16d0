"""One replica's Prometheus metrics, served at GET /metrics.

Each replica has its own registry (tests run several in one process); components record
into it, and the mirror's figures are read at scrape time.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "Metrics", "watch_clock"]

# Lateness and latencies of a scheduler: milliseconds when healthy, seconds in a failover.
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LOOP_PROBE_S = 0.1


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.leader = Gauge(
            "hascheduler_leader", "1 while this replica holds the lease", registry=r
        )
        self.term = Gauge("hascheduler_term", "the lease term this replica last saw", registry=r)
        self.renew_seconds = Histogram(
            "hascheduler_lease_renew_seconds",
            "round trip of one lease acquire-or-renew",
            buckets=SECONDS,
            registry=r,
        )
        self.renew_failures = Counter(
            "hascheduler_lease_renew_failures_total",
            "lease acquire-or-renew attempts that failed (error or timeout)",
            registry=r,
        )
        self.fires = Counter(
            "hascheduler_fires_total",
            "fires this replica moved into a ledger state",
            ["state"],
            registry=r,
        )
        self.lateness = Histogram(
            "hascheduler_fire_lateness_seconds",
            "broker acknowledgement minus due time, per published fire",
            buckets=SECONDS,
            registry=r,
        )
        self.publish_seconds = Histogram(
            "hascheduler_publish_seconds",
            "broker publish of one batch, until acknowledged",
            buckets=SECONDS,
            registry=r,
        )
        self.mirror_size = Gauge(
            "hascheduler_mirror_schedules", "schedules in this replica's mirror", registry=r
        )
        self.mirror_ready = Gauge(
            "hascheduler_mirror_ready", "1 while the mirror is in sync", registry=r
        )
        self.stream_lag = Gauge(
            "hascheduler_change_stream_lag_seconds",
            "now minus the cluster time of the last change event the mirror applied "
            "(grows while nothing changes; NaN before the first event)",
            registry=r,
        )
        self.http = Counter(
            "hascheduler_http_requests_total",
            "HTTP requests by route, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.runs_running = Gauge(
            "hascheduler_runs_running",
            "runs the ledger shows running, per target "
            "(every replica reports the same cluster-wide figure)",
            ["target"],
            registry=r,
        )
        self.runs_stuck = Gauge(
            "hascheduler_runs_stuck",
            "runs shown running whose heartbeat is stale (the run "
            "lease lapsed: the worker died or stalled), per target",
            ["target"],
            registry=r,
        )
        self.flow_in_flight = Gauge(
            "hascheduler_flow_in_flight",
            "concurrency slots held now (runs of a limited key running), per declared key template",
            ["key"],
            registry=r,
        )
        self.flow_waiting = Gauge(
            "hascheduler_flow_waiting",
            "runs waiting for a slot of their concurrency key, per declared key template",
            ["key"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "hascheduler_event_loop_lag_seconds",
            f"how late a {LOOP_PROBE_S:g} s timer fires on this replica's event loop: a long "
            "step holds every task, the lease renewal included",
            buckets=SECONDS,
            registry=r,
        )
        self.namespace_fires = Counter(
            "hascheduler_namespace_fires_total",
            "fires this replica claimed, per namespace",
            ["namespace"],
            registry=r,
        )
        self.quota_deferred = Counter(
            "hascheduler_quota_deferred_total",
            "fires put back to a later slot by their "
            "namespace's fire-rate quota (max_fires_per_second)",
            ["namespace"],
            registry=r,
        )
        schedule = ["schedule", "namespace"]
        self.last_success = Gauge(
            "hascheduler_schedule_last_success_timestamp_seconds",
            "when the schedule's latest succeeded run finished (Unix seconds; NaN before "
            "its first success), for each schedule that declares expect",
            schedule,
            registry=r,
        )
        self.consecutive_failures = Gauge(
            "hascheduler_schedule_consecutive_failures",
            "dead runs since the schedule's last success, for each schedule that declares expect",
            schedule,
            registry=r,
        )
        self.success_deadline = Gauge(
            "hascheduler_schedule_success_deadline_timestamp_seconds",
            "until when the schedule's expect.success_within holds: its last success (or "
            "creation) plus success_within (Unix seconds)",
            schedule,
            registry=r,
        )
        for state in ("claimed", "published", "skipped", "failed"):
            self.fires.labels(state)  # present at zero before the first fire

    def watch(
        self,
        leader: Callable[[], bool],
        term: Callable[[], int],
        size: Callable[[], int],
        ready: Callable[[], bool],
        last_applied: Callable[[], int | None],
        per_namespace: Callable[[], dict[str, int]] = dict,
    ) -> None:
        """Read the replica's state at scrape time (``last_applied``: Unix seconds;
        ``per_namespace``: the mirror's schedules counted by namespace)."""
        self.registry.register(_PerNamespace(per_namespace))
        self.leader.set_function(lambda: 1.0 if leader() else 0.0)
        self.term.set_function(lambda: float(term()))
        self.mirror_size.set_function(lambda: float(size()))
        self.mirror_ready.set_function(lambda: 1.0 if ready() else 0.0)

        def lag() -> float:
            seconds = last_applied()
            return float("nan") if seconds is None else max(0.0, time.time() - seconds)

        self.stream_lag.set_function(lag)

    def runs_seen(
        self,
        running: dict[str, int],
        stuck: dict[str, int],
        in_flight: dict[str, int] | None = None,
        waiting: dict[str, int] | None = None,
    ) -> None:
        """Set the runs gauges from one read of the ledger (a target or key gone reads 0)."""
        for gauge, counts in (
            (self.runs_running, running),
            (self.runs_stuck, stuck),
            (self.flow_in_flight, in_flight or {}),
            (self.flow_waiting, waiting or {}),
        ):
            for (target,) in list(gauge._metrics):
                if target not in counts:
                    gauge.labels(target).set(0)
            for target, count in counts.items():
                gauge.labels(target).set(count)

    def health_seen(self, judged: Sequence[Judgement]) -> None:
        """Set the per-schedule gauges from one round of judgements; a schedule not judged
        (deleted, or no longer declaring expect) loses its series."""
        gauges = (self.last_success, self.consecutive_failures, self.success_deadline)
        seen = {(h.schedule_id, h.namespace) for h in judged}
        for gauge in gauges:
            for labels in list(gauge._metrics):
                if labels not in seen:
                    gauge.remove(*labels)
        for h in judged:
            labels = (h.schedule_id, h.namespace)
            self.last_success.labels(*labels).set(
                h.last_success_at.timestamp() if h.last_success_at else float("nan")
            )
            self.consecutive_failures.labels(*labels).set(h.consecutive_failures)
            self.success_deadline.labels(*labels).set(
                h.success_deadline.timestamp() if h.success_deadline else float("nan")
            )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Judgement(Protocol):
    """A schedule's health as the metrics read it (core/health.ScheduleHealth)."""

    @property
    def schedule_id(self) -> str: ...
    @property
    def namespace(self) -> str: ...
    @property
    def last_success_at(self) -> dt.datetime | None: ...
    @property
    def consecutive_failures(self) -> int: ...
    @property
    def success_deadline(self) -> dt.datetime | None: ...


class ClockReadings(Protocol):
    """What a process knows of the database's clock (core/clock.ServerClock)."""

    def offset_s(self) -> float | None: ...

    def error_s(self) -> float: ...


def watch_clock(registry: CollectorRegistry, clock: ClockReadings) -> None:
    """The clock offset gauges, read at scrape time (a replica's and a worker's)."""
    Gauge(
        "hascheduler_clock_offset_seconds",
        "the database server's clock minus this process's, as best known (NaN before "
        "the first sample)",
        registry=registry,
    ).set_function(lambda: float("nan") if (offset := clock.offset_s()) is None else offset)
    Gauge(
        "hascheduler_clock_error_seconds",
        "how far the clock offset may be off (half the width of its bounds)",
        registry=registry,
    ).set_function(clock.error_s)


class _PerNamespace(Collector):
    """hascheduler_namespace_schedules{namespace}, counted from the mirror at scrape time."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "hascheduler_namespace_schedules",
            "schedules in this replica's mirror, per namespace",
            labels=["namespace"],
        )
        for namespace, count in sorted(self.counts().items()):
            family.add_metric([namespace], count)
        yield family
