"""Backfills: asked of a schedule, read, cancelled."""

from __future__ import annotations

from aiohttp import web

from hascheduler.api.access import Action
from hascheduler.api.context import backfills_of, cluster_of, context
from hascheduler.api.errors import BadRequest
from hascheduler.api.guards import (
    BACKFILL,
    SCHEDULE,
    Guard,
)
from hascheduler.api.middleware import change_by, runs_record
from hascheduler.api.openapi import (
    WRITE,
    json_body,
    responses,
)
from hascheduler.api.params import as_json, now_of, read_json
from hascheduler.api.route import Route
from hascheduler.api.views import (
    shown_time,
)
from hascheduler.core import history, models
from hascheduler.core.errors import RunConflict
from hascheduler.core.triggers import count_between, just_before
from hascheduler.storage import operations
from hascheduler.storage.backfills import Backfill


async def backfill_schedule(request: web.Request) -> web.Response:
    """Fire the schedule's nominal times in [start, end) the ledger has no fire for, worked
    by the leader (storage/backfills.py)."""
    cluster = cluster_of(request)
    backfills = backfills_of(request)
    now = now_of(request)
    wanted = models.BackfillIn.model_validate(await read_json(request), context={"now": now})
    schedule = await context(request).store.get(request.match_info["id"])
    who = change_by(request, schedule.namespace)
    if schedule.paused:
        raise RunConflict(f"schedule {schedule.id!r} is paused; resume it to backfill")
    total = count_between(schedule.compile(), just_before(wanted.start), just_before(wanted.end))
    if total > cluster.max_backfill:
        raise BadRequest(
            422,
            "end",
            f"the range holds {total} fire times; a backfill fires "
            f"at most {cluster.max_backfill} (serve --max-backfill)",
        )
    doc = await backfills.create(
        schedule.id,
        wanted.start,
        wanted.end,
        wanted.overlap,
        total,
        who.name,
        now,
        runs_record(
            request,
            history.BACKFILL,
            who,
            schedule.namespace,
            schedule.id,
            {
                "start": shown_time(wanted.start),
                "end": shown_time(wanted.end),
                "total": total,
                "overlap": wanted.overlap,
            },
            schedule.created_at,
        ),
    )
    return as_json(Backfill.of(doc), 202, Location=f"/backfills/{doc['_id']}")


async def get_backfill(request: web.Request) -> web.Response:
    doc = await backfills_of(request).get(request.match_info["id"])
    if doc is None:
        raise web.HTTPNotFound(reason=f"no backfill {request.match_info['id']!r}")
    return as_json(Backfill.of(doc))


async def cancel_backfill(request: web.Request) -> web.Response:
    backfills = backfills_of(request)
    current = await backfills.get(request.match_info["id"])
    if current is None:
        raise web.HTTPNotFound(reason=f"no backfill {request.match_info['id']!r}")
    schedule_id = str(current["schedule_id"])
    kept = current.get("namespace")
    schedule = await operations.making_schedule(context(request).store, schedule_id, kept)
    namespace = operations.recorded_namespace(kept, schedule)
    doc = await backfills.cancel(
        current["_id"],
        now_of(request),
        runs_record(
            request,
            history.CANCEL,
            change_by(request, namespace),
            namespace,
            schedule_id,
            {"backfill_id": current["_id"]},
            schedule.created_at if schedule is not None else None,
        ),
    )
    if doc is None:
        current = await backfills.get(current["_id"]) or current
        raise RunConflict(
            f"backfill {current['_id']!r} is {current['state']}; only a "
            "running one can be cancelled"
        )
    return as_json(Backfill.of(doc))


ROUTES: list[Route] = [
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
        {
            "summary": "a backfill's progress: fired, skipped, remaining",
            "responses": responses(200, "Backfill", 404, 503),
        },
    ),
    Route(
        "DELETE",
        "/backfills/{id}",
        cancel_backfill,
        Guard(Action.CANCEL, BACKFILL),
        {
            "summary": "cancel a running backfill (what it fired stays fired)",
            "responses": responses(200, "Backfill", 403, 404, 409, 429, 503),
        },
    ),
]
