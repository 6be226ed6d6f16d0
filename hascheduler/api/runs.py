"""Fires and runs: a schedule's fire history and runs, the runs list, one fire, one run,
its retry and its cancel."""

from __future__ import annotations

from aiohttp import web

from hascheduler.api.access import Action
from hascheduler.api.context import cluster_of, context
from hascheduler.api.errors import BadRequest, problem
from hascheduler.api.guards import (
    FIRE,
    LISTING,
    SCHEDULE,
    Guard,
)
from hascheduler.api.middleware import (
    change_by,
    readable_namespaces,
)
from hascheduler.api.openapi import (
    NAMESPACE_PARAM,
    ref,
    responses,
)
from hascheduler.api.params import int_param, now_of
from hascheduler.api.route import Route
from hascheduler.api.run_view import public_view
from hascheduler.api.views import (
    fan_out_fire,
    fire_groups,
    fire_view,
)
from hascheduler.core.constants import (
    DEFAULT_PAGE,
    MAX_PAGE,
)
from hascheduler.core.run_states import STATES
from hascheduler.storage import operations


async def fire_history(request: web.Request) -> web.Response:
    cluster = cluster_of(request)
    schedule_id = request.match_info["id"]
    # 404 for a schedule that does not exist; its fires are those of its namespace.
    namespace = (await context(request).store.get(schedule_id)).namespace
    limit = int_param(request, "limit", 50, 1, MAX_PAGE)
    items = [fire_view(d) for d in await cluster.ledger.history(schedule_id, limit, namespace)]
    return web.json_response({"schedule_id": schedule_id, "items": items})


async def schedule_runs(request: web.Request) -> web.Response:
    cluster = cluster_of(request)
    schedule_id = request.match_info["id"]
    namespace = (await context(request).store.get(schedule_id)).namespace
    limit = int_param(request, "limit", 50, 1, MAX_PAGE)
    by = request.query.get("by")
    if by not in (None, "fire"):
        raise BadRequest(422, "by", "by must be fire (runs counted per fire) or absent")
    if by == "fire":
        nominals = await cluster.ledger.fire_times(schedule_id, limit, namespace)
        groups = await fire_groups(cluster.ledger, cluster.runs, schedule_id, nominals, namespace)
        return web.json_response({"schedule_id": schedule_id, "fires": groups})
    docs = await cluster.runs.for_schedule(schedule_id, limit, namespace)
    return web.json_response({"schedule_id": schedule_id, "items": [public_view(d) for d in docs]})


async def list_runs(request: web.Request) -> web.Response:
    cluster = cluster_of(request)
    state = request.query.get("state")
    if state is not None and state not in STATES:
        raise BadRequest(422, "state", f"state must be one of {', '.join(STATES)}")
    limit = int_param(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
    namespaces = readable_namespaces(request)
    ids = None if namespaces is None else await context(request).store.ids_in(namespaces)
    try:
        docs, after = await cluster.runs.page(
            state, request.query.get("after"), limit, ids, namespaces
        )
    except LookupError:
        return problem(404, "after names no run (it may have expired): list from the start")
    return web.json_response({"items": [public_view(d) for d in docs], "next": after})


async def get_run(request: web.Request) -> web.Response:
    doc = await cluster_of(request).runs.get(request.match_info["id"])
    if doc is None:
        return problem(404, f"no run for fire {request.match_info['id']!r}")
    return web.json_response(public_view(doc))


async def retry_run(request: web.Request) -> web.Response:
    """Replay a dead run (storage/operations.retry); under its schedule's overlap policy,
    not beside another open run of the same key (409)."""
    cluster = cluster_of(request)
    doc = await operations.retry(
        cluster.runs,
        context(request).store,
        cluster.broker,
        request.match_info["id"],
        lambda namespace: change_by(request, namespace),
        now_of(request),
    )
    return web.json_response(public_view(doc), status=202)


async def get_fire(request: web.Request) -> web.Response:
    """One fire's ledger entry, with its run when it has one; a fan-out fire as counts of
    its tenants' entries and runs."""
    cluster = cluster_of(request)
    fire = request.match_info["id"]
    doc = await cluster.ledger.get(fire)
    if doc is None:
        group = await fan_out_fire(cluster.ledger, cluster.runs, fire)
        if group is None:
            raise web.HTTPNotFound(reason=f"no fire {fire!r} in the ledger")
        return web.json_response(group)
    run = await cluster.runs.get(fire)
    return web.json_response(
        {**fire_view(doc), "run": public_view(run) if run is not None else None}
    )


async def cancel_run(request: web.Request) -> web.Response:
    """Cancel a run (storage/operations.cancel): 200 when it ended now, 202 when its
    worker was asked to stop it (within a second)."""
    cluster = cluster_of(request)
    doc, ended = await operations.cancel(
        cluster.ledger,
        cluster.runs,
        context(request).store,
        request.match_info["id"],
        lambda namespace: change_by(request, namespace),
        now_of(request),
    )
    return web.json_response(public_view(doc), status=200 if ended else 202)


ROUTES: list[Route] = [
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
            | {
                "202": {
                    "description": "its worker was asked to stop it",
                    "content": {"application/json": {"schema": ref("Run")}},
                }
            },
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
]
