"""The route table: each route with its handler and its OpenAPI operation, in one place.
The server registers exactly these routes and /openapi.json is generated from them, so
the two cannot drift (tests/test_schemathesis.py checks the served API against it)."""

from __future__ import annotations

import datetime as dt
import functools
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from hascheduler.api.access import Access, AccessFile, Action, WriteLimit, WriteLimiter
from hascheduler.api.audit import audit_log
from hascheduler.api.backfills import backfill_schedule, cancel_backfill, get_backfill
from hascheduler.api.cluster import healthz, leader, members, metrics, mirror_entry, readyz, whoami
from hascheduler.api.context import (
    CONTEXT,
    Cluster,
    Context,
    MirrorReads,
    SourceMirrors,
    TenantReads,
)
from hascheduler.api.dashboard import dashboard, timeline, ui
from hascheduler.api.errors import Handler, error_middleware
from hascheduler.api.guards import (
    BACKFILL,
    BODY,
    CLUSTER_WIDE,
    FIRE,
    LISTING,
    SCHEDULE,
    WEBHOOK,
    Guard,
)
from hascheduler.api.middleware import access_control, known_query, observe_requests
from hascheduler.api.openapi import (
    DOCS_PAGE,
    IDEMPOTENCY_KEY_HEADER,
    IF_MATCH_HEADER,
    LABEL_FILTER,
    NAMESPACE_PARAM,
    SEMANTIC,
    WRITE,
    document,
    json_body,
    ref,
    responses,
)
from hascheduler.api.runs import (
    cancel_run,
    fire_history,
    get_fire,
    get_run,
    list_runs,
    retry_run,
    schedule_runs,
)
from hascheduler.api.schedules import (
    create_schedule,
    create_schedules,
    delete_schedule,
    get_schedule,
    list_schedules,
    next_fires,
    patch_schedule,
    pause_schedule,
    put_schedule,
    restore_schedule,
    resume_schedule,
    schedule_health,
    schedule_history,
    trigger_schedule,
)
from hascheduler.api.webhooks import (
    create_webhook,
    delete_webhook,
    get_webhook,
    list_webhooks,
    webhook_deliveries,
)
from hascheduler.core.clock import Clock, ServerClock
from hascheduler.core.constants import (
    DEFAULT_MIN_FIRE_INTERVAL_S,
    MAX_PAGE,
    MAX_PREVIEW,
    MAX_REQUEST_BYTES,
)
from hascheduler.process.metrics import Metrics
from hascheduler.storage.audit_log import AuditLog
from hascheduler.storage.schedules import ScheduleStore


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    guard: Guard  # who may call it (api/access.py)
    operation: dict[str, Any]  # its OpenAPI operation object


OPEN = Guard(None)


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(_document())


async def docs(request: web.Request) -> web.Response:
    return web.Response(text=DOCS_PAGE, content_type="text/html")


# A page of audit records: the id of the previous page's last record, and its size.
AUDIT_PAGE = [
    {"name": "before", "in": "query", "schema": {"type": "string"}},
    {"name": "limit", "in": "query",
     "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}},
]

ROUTES: list[Route] = [
    Route(
        "POST",
        "/schedules",
        create_schedule,
        Guard(Action.WRITE, BODY),
        {
            "summary": "create a schedule",
            "description": SEMANTIC,
            "requestBody": json_body("ScheduleIn"),
            "responses": responses(201, "Schedule", *WRITE, 409),
        },
    ),
    Route(
        "POST",
        "/schedules:batch",
        create_schedules,
        Guard(Action.WRITE, BODY),
        {
            "summary": "create many schedules: all are checked before any is written; an "
                       "id already taken is left as it was",
            "description": SEMANTIC,
            "requestBody": json_body("ScheduleBatchIn"),
            "responses": responses(200, "BatchCreated", *WRITE),
        },
    ),
    Route(
        "GET",
        "/schedules",
        list_schedules,
        Guard(Action.READ, LISTING),
        {
            "summary": "list schedules (id order, cursor pagination)",
            "parameters": [
                {
                    "name": "label",
                    "in": "query",
                    "description": "key=value; repeat to AND",
                    "schema": {"type": "string", "pattern": LABEL_FILTER},
                },
                {
                    "name": "paused",
                    "in": "query",
                    "schema": {"type": "string", "enum": ["true", "false"]},
                },
                NAMESPACE_PARAM,
                {"name": "after", "in": "query", "schema": {"type": "string"}},
                {
                    "name": "limit",
                    "in": "query",
                    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE},
                },
                {
                    "name": "health",
                    "in": "query",
                    "description": "true: each schedule's health too (health, by id)",
                    "schema": {"type": "string", "enum": ["true", "false"]},
                },
            ],
            "responses": responses(200, "ScheduleList", 422, 503),
        },
    ),
    Route(
        "GET",
        "/schedules/{id}",
        get_schedule,
        Guard(Action.READ, SCHEDULE),
        {"summary": "one schedule", "responses": responses(200, "Schedule", 404)},
    ),
    Route(
        "PUT",
        "/schedules/{id}",
        put_schedule,
        Guard(Action.WRITE, SCHEDULE),
        {
            "summary": "replace a schedule",
            "description": SEMANTIC,
            "parameters": [IF_MATCH_HEADER],
            "requestBody": json_body("ScheduleFields"),
            "responses": responses(200, "Schedule", *WRITE, 404, 409),
        },
    ),
    Route(
        "PATCH",
        "/schedules/{id}",
        patch_schedule,
        Guard(Action.WRITE, SCHEDULE),
        {
            "summary": "change some fields (JSON merge patch: null removes a field)",
            "description": SEMANTIC,
            "parameters": [IF_MATCH_HEADER],
            "requestBody": {
                "required": True,
                "content": {
                    "application/merge-patch+json": {"schema": ref("SchedulePatch")},
                    "application/json": {"schema": ref("SchedulePatch")},
                },
            },
            "responses": responses(200, "Schedule", *WRITE, 404, 409),
        },
    ),
    Route(
        "DELETE",
        "/schedules/{id}",
        delete_schedule,
        Guard(Action.WRITE, SCHEDULE),
        {
            "summary": "delete a schedule",
            "parameters": [IF_MATCH_HEADER],
            "responses": responses(204, None, 400, 403, 404, 409, 429),
        },
    ),
    Route(
        "POST",
        "/schedules/{id}/pause",
        pause_schedule,
        Guard(Action.PAUSE, SCHEDULE),
        {
            "summary": "pause, with an optional note and an instant to resume at by itself",
            "parameters": [IF_MATCH_HEADER],
            "requestBody": {**json_body("PauseIn"), "required": False},
            "responses": responses(200, "Schedule", *WRITE, 404, 409),
        },
    ),
    Route(
        "POST",
        "/schedules/{id}/resume",
        resume_schedule,
        Guard(Action.PAUSE, SCHEDULE),
        {
            "summary": "resume (the record of the pause goes)",
            "parameters": [IF_MATCH_HEADER],
            "responses": responses(200, "Schedule", 400, 403, 404, 409, 429),
        },
    ),
    Route(
        "POST",
        "/schedules/{id}/trigger",
        trigger_schedule,
        Guard(Action.TRIGGER, SCHEDULE),
        {
            "summary": "run now: a fire outside the trigger, published by the leader "
            "within a fraction of a second, under the schedule's overlap policy (or the "
            "one given); a fan-out runs once per tenant its filter selects now "
            "(<fire id>/<tenant>). 409: paused or completed without force, or a fan-out "
            "selecting no tenant or more than the cluster's bound",
            "parameters": [IDEMPOTENCY_KEY_HEADER],
            "requestBody": {**json_body("TriggerIn"), "required": False},
            "responses": responses(202, "Triggered", *WRITE, 404, 409),
        },
    ),
    Route(
        "POST",
        "/schedules/{id}/backfill",
        backfill_schedule,
        Guard(Action.TRIGGER, SCHEDULE),
        {
            "summary": "fire every nominal time in [start, end) the ledger has no fire "
            "for (ordinary fire ids: nothing fires twice), worked by the leader at a "
            "bounded pace and carried across failovers",
            "requestBody": json_body("BackfillIn"),
            "responses": responses(202, "Backfill", *WRITE, 404, 409, 503),
        },
    ),
    Route(
        "GET",
        "/backfills/{id}",
        get_backfill,
        Guard(Action.READ, BACKFILL),
        {"summary": "a backfill's progress: fired, skipped, remaining",
         "responses": responses(200, "Backfill", 404, 503)},
    ),
    Route(
        "DELETE",
        "/backfills/{id}",
        cancel_backfill,
        Guard(Action.CANCEL, BACKFILL),
        {"summary": "cancel a running backfill (what it fired stays fired)",
         "responses": responses(200, "Backfill", 403, 404, 409, 429, 503)},
    ),
    Route(
        "GET",
        "/schedules/{id}/next",
        next_fires,
        Guard(Action.READ, SCHEDULE),
        {
            "summary": "the next nominal and jittered fire times",
            "parameters": [
                {
                    "name": "count",
                    "in": "query",
                    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PREVIEW},
                },
                {
                    "name": "after",
                    "in": "query",
                    "schema": {"type": "string", "format": "date-time"},
                },
            ],
            "responses": responses(200, "Preview", 404, 422),
        },
    ),
    Route(
        "GET",
        "/schedules/{id}/health",
        schedule_health,
        Guard(Action.READ, SCHEDULE),
        {
            "summary": "its last fire, last success, consecutive failures, whether it is "
            "late against its own trigger and whether its objective (expect) is met",
            "responses": responses(200, "ScheduleHealth", 404, 503),
        },
    ),
    Route(
        "GET",
        "/schedules/{id}/fires",
        fire_history,
        Guard(Action.READ, SCHEDULE),
        {
            "summary": "the fire ledger of a schedule, newest first (a skipped range is one "
            "entry with last_nominal_at and count)",
            "parameters": [
                {
                    "name": "limit",
                    "in": "query",
                    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE},
                }
            ],
            "responses": responses(200, None, 404, 422, 503),
        },
    ),
    Route(
        "GET",
        "/schedules/{id}/runs",
        schedule_runs,
        Guard(Action.READ, SCHEDULE),
        {
            "summary": "the runs of a schedule's fires, newest nominal time first; by=fire: "
            "its latest fires, each with its ledger entries (fires) and its runs "
            "counted by state (a fan-out fire has one of each per tenant)",
            "parameters": [
                {
                    "name": "limit",
                    "in": "query",
                    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE},
                },
                {"name": "by", "in": "query", "schema": {"type": "string", "enum": ["fire"]}},
            ],
            "responses": responses(200, None, 404, 422, 503),
        },
    ),
    Route(
        "GET",
        "/runs",
        list_runs,
        Guard(Action.READ, LISTING),
        {
            "summary": "runs, most recently changed first (state=dead: the dead letters)",
            "parameters": [
                {
                    "name": "state",
                    "in": "query",
                    "schema": {
                        "type": "string",
                        "enum": ["running", "succeeded", "retrying", "dead"],
                    },
                },
                NAMESPACE_PARAM,
                {
                    "name": "after",
                    "in": "query",
                    "schema": {"type": "string"},
                    "description": "the next of the previous page: the fire id of its last run "
                    "(404 once that run has expired)",
                },
                {
                    "name": "limit",
                    "in": "query",
                    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE},
                },
            ],
            "responses": responses(200, "RunList", 404, 422, 503),
        },
    ),
    Route(
        "GET",
        "/runs/{id}",
        get_run,
        Guard(Action.READ, FIRE),
        {"summary": "one fire's run", "responses": responses(200, "Run", 404, 503)},
    ),
    Route(
        "POST",
        "/runs/{id}/retry",
        retry_run,
        Guard(Action.TRIGGER, FIRE),
        {
            "summary": "replay a dead run: it is published again and runs with a fresh "
            "attempt budget; under its schedule's overlap policy it is open like any run, "
            "and refused (409) while another run of the same schedule (or tenant) is open",
            "responses": responses(202, "Run", 403, 404, 409, 429, 503),
        },
    ),
    Route(
        "POST",
        "/runs/{id}/cancel",
        cancel_run,
        Guard(Action.CANCEL, FIRE),
        {
            "summary": "cancel a run: a pending or retrying run (or a fire no worker has "
            "claimed yet) ends cancelled at once (200); a running one is stopped by its "
            "worker within a second (202); one already ended is a 409",
            "responses": responses(200, "Run", 403, 404, 409, 429, 503)
            | {"202": {"description": "its worker was asked to stop it",
                       "content": {"application/json": {"schema": ref("Run")}}}},
        },
    ),
    Route(
        "GET",
        "/fires/{id}",
        get_fire,
        Guard(Action.READ, FIRE),
        {
            "summary": "one fire's ledger entry (state, reason, who ran it now), with its "
            "run; a fan-out fire (no tenant in its id) as its tenants' entries and runs "
            "counted by state",
            "responses": responses(200, None, 404, 503),
        },
    ),
    Route(
        "GET",
        "/mirror/{id}",
        mirror_entry,
        Guard(Action.READ, SCHEDULE),
        {
            "summary": "what this replica's mirror holds for a schedule (revision, paused, "
            "next nominal time)",
            "responses": responses(200, None, 404),
        },
    ),
    Route(
        "GET",
        "/audit",
        audit_log,
        Guard(Action.READ, LISTING),
        {
            "summary": "the audit trail, newest first: every change to a schedule or its "
            "runs, with who, when, from where, what (before and after) and why",
            "parameters": [
                NAMESPACE_PARAM,
            ] + [
                {"name": name, "in": "query", "schema": {"type": "string"}}
                for name in ("schedule", "actor")
            ] + [
                {"name": "since", "in": "query",
                 "schema": {"type": "string", "format": "date-time"}},
                *AUDIT_PAGE,
            ],
            "responses": responses(200, None, 403, 404, 422),
        },
    ),
    Route(
        "GET",
        "/schedules/{id}/history",
        schedule_history,
        Guard(Action.READ, SCHEDULE),
        {
            "summary": "a schedule's audit records, newest first (kept after a delete)",
            "parameters": AUDIT_PAGE,
            "responses": responses(200, None, 403, 404, 422),
        },
    ),
    Route(
        "POST",
        "/schedules/{id}/restore",
        restore_schedule,
        Guard(Action.WRITE, SCHEDULE),
        {
            "summary": "put back the fields a schedule had at an earlier revision of its "
            "history (a new revision, recorded as a restore)",
            "parameters": [IF_MATCH_HEADER],
            "requestBody": json_body("RestoreIn"),
            "responses": responses(200, "Schedule", *WRITE, 404, 409),
        },
    ),
    Route(
        "POST",
        "/webhooks",
        create_webhook,
        Guard(Action.ADMIN, BODY),
        {
            "summary": "a webhook: a namespace's (or a schedule's) events POSTed to a URL, "
            "signed; the answer holds its secret, shown once",
            "requestBody": json_body("WebhookIn"),
            "responses": responses(201, "Webhook", *WRITE, 409),
        },
    ),
    Route(
        "GET",
        "/webhooks",
        list_webhooks,
        Guard(Action.READ, LISTING),
        {
            "summary": "the webhooks of the namespaces the caller may read",
            "parameters": [NAMESPACE_PARAM],
            "responses": responses(200, "WebhookList", 403, 422),
        },
    ),
    Route(
        "GET",
        "/webhooks/{id}",
        get_webhook,
        Guard(Action.READ, WEBHOOK),
        {"summary": "one webhook (never its secret)",
         "responses": responses(200, "Webhook", 403, 404)},
    ),
    Route(
        "DELETE",
        "/webhooks/{id}",
        delete_webhook,
        Guard(Action.ADMIN, WEBHOOK),
        {"summary": "delete a webhook and its deliveries",
         "responses": responses(204, None, 403, 404)},
    ),
    Route(
        "GET",
        "/webhooks/{id}/deliveries",
        webhook_deliveries,
        Guard(Action.READ, WEBHOOK),
        {
            "summary": "a webhook's deliveries, newest first: state (pending, delivered, "
            "failed), attempts with their status, error and duration",
            "parameters": [{"name": "limit", "in": "query",
                            "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}}],
            "responses": responses(200, None, 403, 404, 422),
        },
    ),
    Route(
        "GET",
        "/leader",
        leader,
        Guard(Action.READ, CLUSTER_WIDE),
        {
            "summary": "the lease: holder, term, expiry; who answered",
            "responses": responses(200, None, 503),
        },
    ),
    Route(
        "GET",
        "/cluster",
        members,
        Guard(Action.READ, CLUSTER_WIDE),
        {"summary": "members seen recently (heartbeats)", "responses": responses(200, None, 503)},
    ),
    Route(
        "GET",
        "/dashboard",
        dashboard,
        Guard(Action.READ, LISTING),
        {
            "summary": "what /ui shows: leader, members, schedules with "
            "their next fire, recent fires",
            "parameters": [NAMESPACE_PARAM],
            "responses": responses(200, None, 422, 503),
        },
    ),
    Route(
        "GET",
        "/timeline",
        timeline,
        Guard(Action.READ, LISTING),
        {
            "summary": "what /ui draws: each schedule's fires over the last hours as marks "
            "(on_time, late, skipped, failed, dead, running...), lateness over the window, "
            "the runs in flight",
            "parameters": [NAMESPACE_PARAM,
                           {"name": "hours", "in": "query",
                            "schema": {"type": "number", "minimum": 0.05, "maximum": 24}},
                           {"name": "schedule", "in": "query", "schema": {"type": "string"}}],
            "responses": responses(200, None, 403, 404, 422),
        },
    ),
    Route(
        "GET",
        "/whoami",
        whoami,
        Guard(Action.READ, CLUSTER_WIDE),
        {
            "summary": "the caller's token: its name, actions and namespaces (the dashboard "
            "shows only the buttons they allow)",
            "responses": responses(200, None, 403),
        },
    ),
    Route(
        "GET",
        "/metrics",
        metrics,
        OPEN,
        {
            "summary": "Prometheus metrics (no token needed)",
            "security": [],
            "responses": {"200": {"description": "text exposition format"}},
        },
    ),
    Route(
        "GET",
        "/ui",
        ui,
        OPEN,
        {
            "summary": "the dashboard page (it asks for a token itself)",
            "security": [],
            "responses": {"200": {"description": "HTML"}},
        },
    ),
    Route(
        "GET",
        "/healthz",
        healthz,
        OPEN,
        {
            "summary": "the process is alive (no token needed)",
            "security": [],
            "responses": {"200": {"description": "alive"}},
        },
    ),
    Route(
        "GET",
        "/readyz",
        readyz,
        OPEN,
        {
            "summary": "the mirror is in sync (no token needed)",
            "security": [],
            "responses": {
                "200": {
                    "description": "ready",
                    "content": {"application/json": {"schema": ref("MirrorStatus")}},
                },
                "503": {
                    "description": "not ready",
                    "content": {"application/json": {"schema": ref("MirrorStatus")}},
                },
            },
        },
    ),
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
    return document([(r.method, r.path, {
        **r.operation, "x-action": r.guard.action.value if r.guard.action else None})
        for r in ROUTES])


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
) -> web.Application:
    api = web.Application(
        middlewares=[observe_requests, error_middleware, access_control,
                     known_query],
        client_max_size=MAX_REQUEST_BYTES,
    )
    api[CONTEXT] = Context(
        store=store, mirror=mirror, replica_id=replica_id, audit=audit, clock=clock,
        metrics=metrics_ or Metrics(), access=access or AccessFile(Access()),
        limiter=WriteLimiter(write_limit or WriteLimit()),
        guards={(r.method, r.path): r.guard for r in ROUTES},
        query={(r.method, r.path): frozenset(
            p["name"] for p in r.operation.get("parameters", []) if p.get("in") == "query")
            for r in ROUTES},
        min_fire_interval_s=min_fire_interval_s, trace_url=trace_url, cluster=cluster,
        fan_out=fan_out, sources=sources, server_clock=server_clock)
    for route in ROUTES:
        api.router.add_route(route.method, route.path, route.handler)
    return api
