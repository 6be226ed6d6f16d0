"""The route table: each route with its handler and its OpenAPI operation, in one place.
The server registers exactly these routes and /openapi.json is generated from them, so
the two cannot drift (tests/test_schemathesis.py checks the served API against it)."""

from __future__ import annotations

import datetime as dt
import functools
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from hascheduler.api import app
from hascheduler.api.access import Access, AccessFile, Action, WriteLimit, WriteLimiter
from hascheduler.api.errors import Handler, error_middleware
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
from hascheduler.core.clock import ServerClock
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
    guard: app.Guard  # who may call it (api/access.py)
    operation: dict[str, Any]  # its OpenAPI operation object


OPEN = app.Guard(None)


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
        app.create_schedule,
        app.Guard(Action.WRITE, app.BODY),
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
        app.create_schedules,
        app.Guard(Action.WRITE, app.BODY),
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
        app.list_schedules,
        app.Guard(Action.READ, app.LISTING),
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
        app.get_schedule,
        app.Guard(Action.READ, app.SCHEDULE),
        {"summary": "one schedule", "responses": responses(200, "Schedule", 404)},
    ),
    Route(
        "PUT",
        "/schedules/{id}",
        app.put_schedule,
        app.Guard(Action.WRITE, app.SCHEDULE),
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
        app.patch_schedule,
        app.Guard(Action.WRITE, app.SCHEDULE),
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
        app.delete_schedule,
        app.Guard(Action.WRITE, app.SCHEDULE),
        {
            "summary": "delete a schedule",
            "parameters": [IF_MATCH_HEADER],
            "responses": responses(204, None, 400, 403, 404, 409, 429),
        },
    ),
    Route(
        "POST",
        "/schedules/{id}/pause",
        app.pause_schedule,
        app.Guard(Action.PAUSE, app.SCHEDULE),
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
        app.resume_schedule,
        app.Guard(Action.PAUSE, app.SCHEDULE),
        {
            "summary": "resume (the record of the pause goes)",
            "parameters": [IF_MATCH_HEADER],
            "responses": responses(200, "Schedule", 400, 403, 404, 409, 429),
        },
    ),
    Route(
        "POST",
        "/schedules/{id}/trigger",
        app.trigger_schedule,
        app.Guard(Action.TRIGGER, app.SCHEDULE),
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
        app.backfill_schedule,
        app.Guard(Action.TRIGGER, app.SCHEDULE),
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
        app.get_backfill,
        app.Guard(Action.READ, app.BACKFILL),
        {"summary": "a backfill's progress: fired, skipped, remaining",
         "responses": responses(200, "Backfill", 404, 503)},
    ),
    Route(
        "DELETE",
        "/backfills/{id}",
        app.cancel_backfill,
        app.Guard(Action.CANCEL, app.BACKFILL),
        {"summary": "cancel a running backfill (what it fired stays fired)",
         "responses": responses(200, "Backfill", 403, 404, 409, 429, 503)},
    ),
    Route(
        "GET",
        "/schedules/{id}/next",
        app.next_fires,
        app.Guard(Action.READ, app.SCHEDULE),
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
        app.schedule_health,
        app.Guard(Action.READ, app.SCHEDULE),
        {
            "summary": "its last fire, last success, consecutive failures, whether it is "
            "late against its own trigger and whether its objective (expect) is met",
            "responses": responses(200, "ScheduleHealth", 404, 503),
        },
    ),
    Route(
        "GET",
        "/schedules/{id}/fires",
        app.fire_history,
        app.Guard(Action.READ, app.SCHEDULE),
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
        app.schedule_runs,
        app.Guard(Action.READ, app.SCHEDULE),
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
        app.list_runs,
        app.Guard(Action.READ, app.LISTING),
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
        app.get_run,
        app.Guard(Action.READ, app.FIRE),
        {"summary": "one fire's run", "responses": responses(200, "Run", 404, 503)},
    ),
    Route(
        "POST",
        "/runs/{id}/retry",
        app.retry_run,
        app.Guard(Action.TRIGGER, app.FIRE),
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
        app.cancel_run,
        app.Guard(Action.CANCEL, app.FIRE),
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
        app.get_fire,
        app.Guard(Action.READ, app.FIRE),
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
        app.mirror_entry,
        app.Guard(Action.READ, app.SCHEDULE),
        {
            "summary": "what this replica's mirror holds for a schedule (revision, paused, "
            "next nominal time)",
            "responses": responses(200, None, 404),
        },
    ),
    Route(
        "GET",
        "/audit",
        app.audit_log,
        app.Guard(Action.READ, app.LISTING),
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
        app.schedule_history,
        app.Guard(Action.READ, app.SCHEDULE),
        {
            "summary": "a schedule's audit records, newest first (kept after a delete)",
            "parameters": AUDIT_PAGE,
            "responses": responses(200, None, 403, 404, 422),
        },
    ),
    Route(
        "POST",
        "/schedules/{id}/restore",
        app.restore_schedule,
        app.Guard(Action.WRITE, app.SCHEDULE),
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
        app.create_webhook,
        app.Guard(Action.ADMIN, app.BODY),
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
        app.list_webhooks,
        app.Guard(Action.READ, app.LISTING),
        {
            "summary": "the webhooks of the namespaces the caller may read",
            "parameters": [NAMESPACE_PARAM],
            "responses": responses(200, "WebhookList", 403, 422),
        },
    ),
    Route(
        "GET",
        "/webhooks/{id}",
        app.get_webhook,
        app.Guard(Action.READ, app.WEBHOOK),
        {"summary": "one webhook (never its secret)",
         "responses": responses(200, "Webhook", 403, 404)},
    ),
    Route(
        "DELETE",
        "/webhooks/{id}",
        app.delete_webhook,
        app.Guard(Action.ADMIN, app.WEBHOOK),
        {"summary": "delete a webhook and its deliveries",
         "responses": responses(204, None, 403, 404)},
    ),
    Route(
        "GET",
        "/webhooks/{id}/deliveries",
        app.webhook_deliveries,
        app.Guard(Action.READ, app.WEBHOOK),
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
        app.leader,
        app.Guard(Action.READ, app.CLUSTER_WIDE),
        {
            "summary": "the lease: holder, term, expiry; who answered",
            "responses": responses(200, None, 503),
        },
    ),
    Route(
        "GET",
        "/cluster",
        app.members,
        app.Guard(Action.READ, app.CLUSTER_WIDE),
        {"summary": "members seen recently (heartbeats)", "responses": responses(200, None, 503)},
    ),
    Route(
        "GET",
        "/dashboard",
        app.dashboard,
        app.Guard(Action.READ, app.LISTING),
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
        app.timeline,
        app.Guard(Action.READ, app.LISTING),
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
        app.whoami,
        app.Guard(Action.READ, app.CLUSTER_WIDE),
        {
            "summary": "the caller's token: its name, actions and namespaces (the dashboard "
            "shows only the buttons they allow)",
            "responses": responses(200, None, 403),
        },
    ),
    Route(
        "GET",
        "/metrics",
        app.metrics,
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
        app.ui,
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
        app.healthz,
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
        app.readyz,
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


def create_app(
    store: ScheduleStore,
    mirror: app.Mirror,
    replica_id: str,
    audit: AuditLog,
    clock: app.Clock = lambda: dt.datetime.now(dt.UTC),
    cluster: app.Cluster | None = None,
    metrics_: Metrics | None = None,
    access: AccessFile | None = None,
    write_limit: WriteLimit | None = None,
    min_fire_interval_s: float = DEFAULT_MIN_FIRE_INTERVAL_S,
    fan_out: tuple[int, app.TenantReads] | None = None,
    sources: app.SourceMirrors | None = None,
    server_clock: ServerClock | None = None,
    trace_url: str | None = None,
) -> web.Application:
    api = web.Application(
        middlewares=[app.observe_requests, error_middleware, app.access_control,
                     app.known_query],
        client_max_size=MAX_REQUEST_BYTES,
    )
    api[app.METRICS] = metrics_ or Metrics()
    api[app.ACCESS] = access or AccessFile(Access())
    api[app.AUDIT] = audit
    api[app.GUARDS] = {(r.method, r.path): r.guard for r in ROUTES}
    api[app.QUERY] = {(r.method, r.path): frozenset(
        p["name"] for p in r.operation.get("parameters", []) if p.get("in") == "query")
        for r in ROUTES}
    api[app.LIMITER] = WriteLimiter(write_limit or WriteLimit())
    api[app.STORE] = store
    api[app.MIRROR] = mirror
    api[app.REPLICA] = replica_id
    api[app.CLOCK] = clock
    api[app.MIN_FIRE_INTERVAL] = min_fire_interval_s
    api[app.TRACE_URL] = trace_url
    if fan_out is not None:
        api[app.FAN_OUT] = fan_out
    if sources is not None:
        api[app.SOURCES] = sources
    if server_clock is not None:
        api[app.SERVER_CLOCK] = server_clock
    if cluster is not None:
        api[app.CLUSTER] = cluster
    for route in ROUTES:
        api.router.add_route(route.method, route.path, route.handler)
    return api
