"""The route table: each route with its handler and its OpenAPI operation, in one place.
The server registers exactly these routes and /openapi.json is generated from them, so
the two cannot drift (tests/test_schemathesis.py checks the served API against it)."""

from __future__ import annotations

import datetime as dt
import functools
from typing import Any

from aiohttp import web

from hascheduler.api.access import Access, WriteLimit, WriteLimiter
from hascheduler.api.access_file import AccessFile
from hascheduler.api.audit import ROUTES as AUDIT
from hascheduler.api.backfills import ROUTES as BACKFILLS
from hascheduler.api.cluster import ROUTES as CLUSTER
from hascheduler.api.context import (
    CONTEXT,
    Cluster,
    Context,
    MirrorReads,
    SourceMirrors,
    TenantReads,
)
from hascheduler.api.dashboard import ROUTES as DASHBOARD
from hascheduler.api.errors import error_middleware
from hascheduler.api.middleware import access_control, known_query, observe_requests
from hascheduler.api.openapi import (
    DOCS_PAGE,
    document,
)
from hascheduler.api.route import OPEN, Route
from hascheduler.api.run_now import ROUTES as RUN_NOW
from hascheduler.api.runs import ROUTES as RUNS
from hascheduler.api.schedules import ROUTES as SCHEDULES
from hascheduler.api.webhooks import ROUTES as WEBHOOKS
from hascheduler.core.clock import Clock, ServerClock
from hascheduler.core.constants import (
    DEFAULT_MIN_FIRE_INTERVAL_S,
    MAX_REQUEST_BYTES,
)
from hascheduler.core.egress import PUBLIC_ONLY, EgressPolicy
from hascheduler.process.metrics import Metrics
from hascheduler.storage.audit_log import AuditLog
from hascheduler.storage.schedules import ScheduleStore


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(_document())


async def docs(request: web.Request) -> web.Response:
    return web.Response(text=DOCS_PAGE, content_type="text/html")


ROUTES: list[Route] = [
    *SCHEDULES,
    *RUN_NOW,
    *BACKFILLS,
    *RUNS,
    *CLUSTER,
    *AUDIT,
    *WEBHOOKS,
    *DASHBOARD,
    Route(
        "GET",
        "/openapi.json",
        openapi,
        OPEN,
        {
            "summary": "this document",
            "security": [],
            "responses": {"200": {"description": "OpenAPI 3.1"}},
        },
    ),
    Route(
        "GET",
        "/docs",
        docs,
        OPEN,
        {
            "summary": "this document for a person",
            "security": [],
            "responses": {"200": {"description": "HTML"}},
        },
    ),
]


@functools.cache
def _document() -> dict[str, Any]:
    return document(
        [
            (
                r.method,
                r.path,
                {**r.operation, "x-action": r.guard.action.value if r.guard.action else None},
            )
            for r in ROUTES
        ]
    )


def create_app(  # noqa: PLR0913 (the composition root of the API: every part it serves)
    store: ScheduleStore,
    mirror: MirrorReads,
    replica_id: str,
    audit: AuditLog,
    clock: Clock = lambda: dt.datetime.now(dt.UTC),
    cluster: Cluster | None = None,
    metrics_: Metrics | None = None,
    access: AccessFile | None = None,
    write_limit: WriteLimit | None = None,
    min_fire_interval_s: float = DEFAULT_MIN_FIRE_INTERVAL_S,
    fan_out: tuple[int, TenantReads] | None = None,
    sources: SourceMirrors | None = None,
    server_clock: ServerClock | None = None,
    trace_url: str | None = None,
    egress: EgressPolicy = PUBLIC_ONLY,
    metrics_need_token: bool = False,
) -> web.Application:
    api = web.Application(
        middlewares=[observe_requests, error_middleware, access_control, known_query],
        client_max_size=MAX_REQUEST_BYTES,
    )
    api[CONTEXT] = Context(
        store=store,
        mirror=mirror,
        replica_id=replica_id,
        audit=audit,
        clock=clock,
        metrics=metrics_ or Metrics(),
        access=access or AccessFile(Access()),
        limiter=WriteLimiter(write_limit or WriteLimit()),
        guards={(r.method, r.path): r.guard for r in ROUTES},
        query={
            (r.method, r.path): frozenset(
                p["name"] for p in r.operation.get("parameters", []) if p.get("in") == "query"
            )
            for r in ROUTES
        },
        min_fire_interval_s=min_fire_interval_s,
        trace_url=trace_url,
        cluster=cluster,
        fan_out=fan_out,
        sources=sources,
        server_clock=server_clock,
        egress=egress,
        metrics_need_token=metrics_need_token,
    )
    for route in ROUTES:
        api.router.add_route(route.method, route.path, route.handler)
    return api
