"""What the API's handlers share: the replica's parts they read and write, as one typed
record (``Context``) on the application, and the protocols of the parts it reads."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from hascheduler.api.access import WriteLimiter
from hascheduler.api.access_file import AccessFile
from hascheduler.api.guards import Guard
from hascheduler.brokers.base import Broker
from hascheduler.core.clock import Clock, ServerClock
from hascheduler.core.constants import (
    DEFAULT_MAX_BACKFILL,
)
from hascheduler.core.egress import PUBLIC_ONLY, EgressPolicy
from hascheduler.core.entries import Entry
from hascheduler.core.fanout import FanOut
from hascheduler.process.metrics import Metrics
from hascheduler.storage.audit_log import AuditLog
from hascheduler.storage.backfills import Backfills
from hascheduler.storage.collection import Collection
from hascheduler.storage.fires import Ledger
from hascheduler.storage.health import HealthReader
from hascheduler.storage.members import Members
from hascheduler.storage.runs import RunLedger
from hascheduler.storage.schedules import ScheduleStore
from hascheduler.storage.webhooks import Deliveries, WebhookStore


class MirrorReads(Protocol):
    """The replica's schedules mirror (replica/mirror.py), as the API reads it."""

    @property
    def entries(self) -> Mapping[str, Entry]: ...
    @property
    def recently_applied(self) -> Mapping[str, float]: ...

    def status(self) -> dict[str, Any]: ...


class TenantReads(Protocol):
    """What a fan-out selects now (storage/tenants.TenantDocuments)."""

    async def count(self, fan_out: FanOut, limit: int) -> int: ...
    async def keys(self, fan_out: FanOut, limit: int) -> list[str] | None: ...


class SourceMirrors(Protocol):
    """The replica's fan-out source mirrors (tenants.Sources), for /readyz."""

    @property
    def ready(self) -> bool: ...
    def summary(self) -> dict[str, Any]: ...


class Leading(Protocol):
    """Whether this replica leads now (the elector)."""

    @property
    def is_leader(self) -> bool: ...

    @property
    def unfit_reason(self) -> str | None: ...  # why it may not lead now, if so


class Cluster:
    """What the API reads about leadership, members and the fire ledger."""

    def __init__(
        self,
        leases: Collection,
        members: Members,
        ledger: Ledger,
        elector: Leading,
        runs: RunLedger,
        broker: Broker,
        backfills: Backfills | None = None,
        max_backfill: int = DEFAULT_MAX_BACKFILL,
        health: HealthReader | None = None,
        webhooks: tuple[WebhookStore, Deliveries] | None = None,
    ) -> None:
        self.health = health or HealthReader(ledger, runs)
        self.webhooks = webhooks
        self.backfills = backfills
        self.max_backfill = max_backfill
        self.leases = leases
        self.members = members
        self.ledger = ledger
        self.elector = elector
        self.runs = runs
        self.broker = broker  # a replay of a dead run is published from any replica


@dataclass(frozen=True)
class Context:
    """The replica's parts, as every handler and middleware reads them."""

    store: ScheduleStore
    mirror: MirrorReads
    replica_id: str
    audit: AuditLog
    clock: Clock
    metrics: Metrics
    access: AccessFile
    limiter: WriteLimiter
    # Each route's guard and the query parameters it takes, by (method, route template):
    # from the route table, so what is served and what is documented are one list.
    guards: Mapping[tuple[str, str], Guard]
    query: Mapping[tuple[str, str], frozenset[str]]
    min_fire_interval_s: float
    trace_url: str | None = None
    # Leadership, runs, backfills, webhooks (None: a replica serving the schedules alone).
    cluster: Cluster | None = None
    # The bound on a fan-out's tenants, and how to read what one selects.
    fan_out: tuple[int, TenantReads] | None = None
    sources: SourceMirrors | None = None
    server_clock: ServerClock | None = None
    egress: EgressPolicy = PUBLIC_ONLY  # where a webhook's URL may point
    metrics_need_token: bool = False  # GET /metrics only to a token that may read


CONTEXT = web.AppKey("context", Context)


def context(request: web.Request) -> Context:
    return request.app[CONTEXT]


def cluster_of(request: web.Request) -> Cluster:
    cluster = context(request).cluster
    if cluster is None:
        raise web.HTTPServiceUnavailable(reason="leadership is not configured here")
    return cluster


def backfills_of(request: web.Request) -> Backfills:
    backfills = cluster_of(request).backfills
    if backfills is None:
        raise web.HTTPServiceUnavailable(reason="this replica keeps no backfills")
    return backfills


def webhooks_of(request: web.Request) -> tuple[WebhookStore, Deliveries]:
    webhooks = cluster_of(request).webhooks
    if webhooks is None:
        raise web.HTTPServiceUnavailable(reason="webhooks are not configured here")
    return webhooks
