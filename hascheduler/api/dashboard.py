"""The dashboard: its page, its one read, and the timeline."""

from __future__ import annotations

import math
from pathlib import Path

from aiohttp import web

from hascheduler.api.access import Action
from hascheduler.api.cluster import leader_view, members_view
from hascheduler.api.context import cluster_of, context
from hascheduler.api.errors import BadRequest
from hascheduler.api.guards import (
    LISTING,
    Guard,
)
from hascheduler.api.middleware import readable_namespaces, require
from hascheduler.api.openapi import (
    NAMESPACE_PARAM,
    responses,
)
from hascheduler.api.params import now_of
from hascheduler.api.route import OPEN, Route
from hascheduler.api.views import (
    TIMELINE_MAX_HOURS,
    read_dashboard,
    read_timeline,
)

# The dashboard's page: one static file, no build step, read once at import.
UI_PAGE = (Path(__file__).parent / "ui.html").read_text()


# Everything the page needs is inline or same-origin; nothing else may load or run.
UI_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)


async def dashboard(request: web.Request) -> web.Response:
    """Everything /ui shows, in one read (views.read_dashboard) and the cluster's state."""
    cluster = cluster_of(request)
    now = now_of(request)
    view = await read_dashboard(
        context(request).store, cluster.ledger, cluster.runs, now, readable_namespaces(request)
    )
    return web.json_response(
        {
            **view.as_json(),
            "now": now.isoformat(),
            "leader": await leader_view(request, cluster),
            "members": await members_view(request, cluster),
        }
    )


async def timeline(request: web.Request) -> web.Response:
    """Each schedule's recent fires as marks, lateness over time, runs in flight
    (views.read_timeline)."""
    cluster = cluster_of(request)
    text = request.query.get("hours", "1")
    try:
        hours = float(text)
    except ValueError:
        hours = math.nan
    if not 0.05 <= hours <= TIMELINE_MAX_HOURS:  # NaN fails this too
        raise BadRequest(
            422, "hours", f"hours must be a number from 0.05 to {TIMELINE_MAX_HOURS:g}"
        )
    schedule_id = request.query.get("schedule")
    namespaces = readable_namespaces(request)
    if schedule_id is not None:
        schedule = await context(request).store.get(schedule_id)
        require(request, Action.READ, schedule.namespace)
    view = await read_timeline(
        context(request).store,
        cluster.ledger,
        cluster.runs,
        now_of(request),
        hours,
        namespaces,
        schedule_id,
    )
    return web.json_response({**view, "trace_url": context(request).trace_url})


async def ui(request: web.Request) -> web.Response:
    return web.Response(
        text=UI_PAGE,
        content_type="text/html",
        headers={"Cache-Control": "no-cache", "Content-Security-Policy": UI_CSP},
    )


ROUTES: list[Route] = [
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
            "parameters": [
                NAMESPACE_PARAM,
                {
                    "name": "hours",
                    "in": "query",
                    "schema": {"type": "number", "minimum": 0.05, "maximum": 24},
                },
                {"name": "schedule", "in": "query", "schema": {"type": "string"}},
            ],
            "responses": responses(200, None, 403, 404, 422),
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
]
