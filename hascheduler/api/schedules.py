"""Schedules: create, list, read, replace, patch, delete, pause and resume, the next fires,
health and restore (run now is api/run_now.py; a schedule's history is read in
api/audit.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from typing import Any

import structlog
from aiohttp import web

from hascheduler.api.access import Action
from hascheduler.api.context import cluster_of, context
from hascheduler.api.errors import BadRequest
from hascheduler.api.guards import (
    BODY,
    LISTING,
    SCHEDULE,
    Guard,
)
from hascheduler.api.middleware import (
    actor,
    change_by,
    grant_of,
    readable_namespaces,
    require,
)
from hascheduler.api.openapi import (
    IF_MATCH_HEADER,
    LABEL_FILTER,
    NAMESPACE_PARAM,
    SEMANTIC,
    WRITE,
    json_body,
    ref,
    responses,
)
from hascheduler.api.params import (
    as_json,
    bool_param,
    expected_revision,
    int_param,
    now_of,
    read_json,
    read_optional_json,
    time_param,
    validate,
)
from hascheduler.api.route import Route
from hascheduler.core import history, models
from hascheduler.core.constants import (
    DEFAULT_PAGE,
    MAX_PAGE,
    MAX_PREVIEW,
)
from hascheduler.core.history import Actor
from hascheduler.storage import operations

log = structlog.get_logger("hascheduler.api")


def _schedule_response(
    request: web.Request, schedule: models.Schedule, status: int = 200, **headers: str
) -> web.Response:
    """The schedule as written; to a token that may not read its namespace (write only),
    its id and revision alone: a write is no way to read."""
    if not grant_of(request).allows(Action.READ, schedule.namespace):
        return web.json_response(
            {"id": schedule.id, "revision": schedule.revision},
            status=status,
            headers={"ETag": f'"{schedule.revision}"', **headers},
        )
    return as_json(schedule, status, ETag=f'"{schedule.revision}"', **headers)


async def _check_fan_out(request: web.Request, fields: models.ScheduleFields) -> None:
    """A fan-out over a collection its namespace is not granted (the access file's
    ``fan_out_sources``) is refused when written (422 on fan_out.collection), and one
    selecting more tenants than the bound (422 on fan_out); counting stops one past the
    bound, so the check costs what it may."""
    if fields.fan_out is None:
        return
    rules = context(request).access.current.rules_of(fields.namespace)
    collection = fields.fan_out.collection
    if rules.fan_out_sources is not None and collection not in rules.fan_out_sources:
        raise BadRequest(
            422,
            "fan_out.collection",
            f"namespace {fields.namespace!r} may not read {collection!r} as a fan-out "
            "source: the access file's namespaces entry grants sources (fan_out_sources)",
        )
    bounded = context(request).fan_out
    if bounded is None:
        return
    limit, tenants = bounded
    quota = rules.max_fan_out
    bound = (
        "the cluster's bound is serve --max-fan-out"
        if quota is None or quota >= limit
        else f"namespace {fields.namespace!r} has a max_fan_out quota of {quota}"
    )
    limit = limit if quota is None else min(limit, quota)
    selected = await tenants.count(fields.fan_out, limit + 1)
    if selected > limit:
        raise BadRequest(
            422,
            "fan_out",
            f"the filter selects more than {limit} documents "
            f"of {fields.fan_out.collection!r}; {bound}",
        )


async def _check_quota(request: web.Request, namespace: str, adding: int) -> None:
    """A namespace at its max_schedules takes no more (422 naming the quota)."""
    limit = context(request).access.current.rules_of(namespace).max_schedules
    if limit is not None and await context(request).store.count(namespace) + adding > limit:
        raise BadRequest(
            422,
            "namespace",
            f"namespace {namespace!r} holds at most {limit} schedules (its max_schedules quota)",
        )


async def create_schedule(request: web.Request) -> web.Response:
    body = await read_json(request)
    now = now_of(request)
    new = validate(request, models.ScheduleIn, body, now)
    require(request, Action.WRITE, new.namespace)
    who = change_by(request, new.namespace)
    await _check_quota(request, new.namespace, 1)
    await _check_fan_out(request, new)
    schedule = await context(request).store.create(new, now, who)
    return _schedule_response(request, schedule, 201, Location=f"/schedules/{schedule.id}")


async def create_schedules(request: web.Request) -> web.Response:
    """Many schedules in one round trip (``hascheduler apply``): every one is checked
    first, as POST /schedules checks it; nothing is written unless all are valid. An id
    already taken is left as it was and answered in ``existing``."""
    body = await read_json(request)
    now = now_of(request)
    batch = validate(request, models.ScheduleBatchIn, body, now)
    who = actor(request)
    added: dict[str, int] = {}
    for new in batch.schedules:
        added[new.namespace] = added.get(new.namespace, 0) + 1
    for namespace, count in sorted(added.items()):
        require(request, Action.WRITE, namespace)
        change_by(request, namespace, who)
        await _check_quota(request, namespace, count)
    for new in batch.schedules:
        await _check_fan_out(request, new)
    created, existing = await context(request).store.create_many(batch.schedules, now, who)
    return as_json(models.BatchCreated(created=created, existing=existing))


async def list_schedules(request: web.Request) -> web.Response:
    labels: dict[str, str] = {}
    for value in request.query.getall("label", []):
        if not re.match(LABEL_FILTER, value):
            raise BadRequest(422, "label", "label filters look like label=key=value")
        key, _, text = value.partition("=")
        labels[key] = text
    items, after = await context(request).store.list(
        labels=labels,
        paused=bool_param(request, "paused"),
        after=request.query.get("after"),
        limit=int_param(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE),
        namespaces=readable_namespaces(request),
    )
    health = None
    if bool_param(request, "health"):
        found = await cluster_of(request).health.many(items, now_of(request))
        health = {h.schedule_id: h for h in found}
    return as_json(models.ScheduleList(items=items, next=after, health=health))


async def schedule_health(request: web.Request) -> web.Response:
    """Its last fire, last success, consecutive failures, lateness against its own trigger
    and its objective (core/health.py)."""
    schedule = await context(request).store.get(request.match_info["id"])
    return as_json(await cluster_of(request).health.of(schedule, now_of(request)))


async def get_schedule(request: web.Request) -> web.Response:
    return _schedule_response(request, await context(request).store.get(request.match_info["id"]))


async def put_schedule(request: web.Request) -> web.Response:
    body = await read_json(request)
    if "id" in body and body["id"] != request.match_info["id"]:
        raise BadRequest(422, "id", "the id in the body differs from the one in the path")
    body.pop("id", None)
    now = now_of(request)
    fields = validate(request, models.ScheduleFields, body, now)
    who = await _writing(request, request.match_info["id"], fields.namespace)
    await _check_fan_out(request, fields)
    schedule = await context(request).store.replace(
        request.match_info["id"], fields, now, expected_revision(request), who
    )
    return _schedule_response(request, schedule)


async def _schedule_actor(
    request: web.Request, schedule_id: str, given: Actor | None = None
) -> Actor:
    """``actor`` (or ``given``) for a change to a stored schedule, refused without the
    reason its namespace may require (read only when some namespace requires one)."""
    who = given or actor(request)
    rules = context(request).access.current.rules
    if who.reason is None and any(r.require_reason for r in rules.values()):
        namespace = await context(request).store.namespace_of(schedule_id)
        if namespace is not None:
            change_by(request, namespace, who)
    return who


async def _writing(request: web.Request, schedule_id: str, namespace: str) -> Actor:
    """A replacement of a schedule's fields, which may move it to ``namespace``: the
    caller must reach that namespace too, and its quota and rules apply."""
    require(request, Action.WRITE, namespace)
    who = change_by(request, namespace, await _schedule_actor(request, schedule_id))
    if context(request).access.current.rules_of(
        namespace
    ).max_schedules is not None and await context(request).store.namespace_of(schedule_id) not in (
        namespace,
        None,
    ):
        await _check_quota(request, namespace, 1)
    return who


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


async def patch_schedule(request: web.Request) -> web.Response:
    patch = await read_json(request)
    schedule_id = request.match_info["id"]
    for server_field in (
        "id",
        "created_at",
        "updated_at",
        "revision",
        "pause",
        "completed",
        "fires_remaining",
    ):
        if server_field in patch:
            raise BadRequest(422, server_field, f"{server_field} is set by the server")
    store = context(request).store
    expected = expected_revision(request)
    current = await store.get(schedule_id)
    client_fields = set(models.ScheduleFields.model_fields)
    merged = _merge_patch(current.model_dump(mode="json", include=client_fields), patch)
    now = now_of(request)
    fields = validate(
        request, models.ScheduleFields, merged, now, stored_trigger="trigger" not in patch
    )
    who = await _writing(request, schedule_id, fields.namespace)
    await _check_fan_out(request, fields)
    # Without If-Match, the revision read above still guards against a lost update.
    schedule = await store.replace(
        schedule_id, fields, now, expected if expected is not None else current.revision, who
    )
    return _schedule_response(request, schedule)


async def delete_schedule(request: web.Request) -> web.Response:
    schedule_id = request.match_info["id"]
    await context(request).store.delete(
        schedule_id,
        expected_revision(request),
        await _schedule_actor(request, schedule_id),
        now_of(request),
    )
    return web.Response(status=204)


async def pause_schedule(request: web.Request) -> web.Response:
    """Pause, with an optional note and an instant to resume at by itself."""
    now = now_of(request)
    wanted = models.PauseIn.model_validate(await read_optional_json(request), context={"now": now})
    schedule_id = request.match_info["id"]
    who = actor(request)
    if who.reason is None and wanted.note is not None:  # the pause's note says why
        who = dataclasses.replace(who, reason=wanted.note)
    who = await _schedule_actor(request, schedule_id, who)
    schedule = await context(request).store.pause(
        schedule_id, now, who, wanted.note, wanted.until, expected_revision(request)
    )
    return _schedule_response(request, schedule)


async def resume_schedule(request: web.Request) -> web.Response:
    schedule_id = request.match_info["id"]
    schedule = await context(request).store.resume(
        schedule_id,
        now_of(request),
        expected_revision(request),
        await _schedule_actor(request, schedule_id),
    )
    return _schedule_response(request, schedule)


async def next_fires(request: web.Request) -> web.Response:
    count = int_param(request, "count", 5, 1, MAX_PREVIEW)
    after = time_param(request, "after", now_of(request))
    schedule = await context(request).store.get(request.match_info["id"])
    # A thousand times of a rare expression take a quarter of a second to work out: off
    # the loop, which must keep renewing the lease meanwhile.
    return as_json(await asyncio.to_thread(models.preview, schedule, after, count))


async def restore_schedule(request: web.Request) -> web.Response:
    """Put a schedule's fields back as they were at an earlier revision (a new revision,
    recorded as a restore). A payload the trail keeps redacted stays as it is now."""
    schedule_id = request.match_info["id"]
    wanted = models.RestoreIn.model_validate(await read_json(request))
    store = context(request).store
    current = await store.get(schedule_id)
    record = await context(request).audit.revision(
        schedule_id, wanted.revision, current.created_at, current.namespace
    )
    if record is None:
        raise BadRequest(
            404,
            "revision",
            f"schedule {schedule_id!r} has no revision {wanted.revision} in its history "
            "(this schedule's, in its namespace)",
        )
    fields = operations.revision_fields(record, current)
    now = now_of(request)
    restored = validate(request, models.ScheduleFields, fields, now, stored_trigger=True)
    who = await _writing(request, schedule_id, restored.namespace)
    await _check_fan_out(request, restored)
    expected = expected_revision(request)
    schedule = await store.replace(
        schedule_id,
        restored,
        now,
        expected if expected is not None else current.revision,
        dataclasses.replace(who, origin=None),
        history.RESTORE,
    )
    return _schedule_response(request, schedule)


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
]
