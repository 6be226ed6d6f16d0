"""The audit trail, read: all of it, and one schedule's history."""

from __future__ import annotations

import contextlib

from aiohttp import web

from hascheduler.api.access import Action
from hascheduler.api.context import context
from hascheduler.api.errors import problem
from hascheduler.api.guards import LISTING, SCHEDULE, Guard
from hascheduler.api.middleware import readable_namespaces
from hascheduler.api.openapi import (
    NAMESPACE_PARAM,
    responses,
)
from hascheduler.api.params import int_param, now_of, time_param
from hascheduler.api.route import Route
from hascheduler.core import history
from hascheduler.core.constants import DEFAULT_PAGE, MAX_PAGE
from hascheduler.core.errors import ScheduleNotFound


async def audit_log(request: web.Request) -> web.Response:
    """The audit trail, newest first: ?namespace=&schedule=&actor=&since=&before=&limit=."""
    since = request.query.get("since")
    try:
        docs = await context(request).audit.query(
            namespaces=readable_namespaces(request),
            schedule_id=request.query.get("schedule"),
            actor=request.query.get("actor"),
            since=None if since is None else time_param(request, "since", now_of(request)),
            before=request.query.get("before"),
            limit=int_param(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE),
        )
    except LookupError:
        return problem(404, "before names no record (it may have expired): list from the start")
    items = [history.public(d) for d in docs]
    return web.json_response(
        {
            "items": items,
            "next": items[-1]["id"]
            if len(items) == int_param(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
            else None,
        }
    )


async def schedule_history(request: web.Request) -> web.Response:
    """Every recorded change of one schedule, newest first (kept after it is deleted): of
    the live one, its own incarnation's (an id reused after a delete starts anew)."""
    schedule_id = request.match_info["id"]
    limit = int_param(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
    incarnation = None
    with contextlib.suppress(ScheduleNotFound):
        incarnation = (await context(request).store.get(schedule_id)).created_at
    try:
        docs = await context(request).audit.query(
            namespaces=readable_namespaces(request),
            schedule_id=schedule_id,
            before=request.query.get("before"),
            limit=limit,
            incarnation=incarnation,
        )
    except LookupError:
        return problem(404, "before names no record of this schedule")
    if not docs and request.query.get("before") is None:
        raise ScheduleNotFound(schedule_id)
    items = [history.public(d) for d in docs]
    return web.json_response(
        {
            "schedule_id": schedule_id,
            "items": items,
            "next": items[-1]["id"] if len(items) == limit else None,
        }
    )


# A page of audit records: the id of the previous page's last record, and its size.
AUDIT_PAGE = [
    {"name": "before", "in": "query", "schema": {"type": "string"}},
    {
        "name": "limit",
        "in": "query",
        "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE},
    },
]

ROUTES: list[Route] = [
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
            ]
            + [
                {"name": name, "in": "query", "schema": {"type": "string"}}
                for name in ("schedule", "actor")
            ]
            + [
                {
                    "name": "since",
                    "in": "query",
                    "schema": {"type": "string", "format": "date-time"},
                },
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
]
