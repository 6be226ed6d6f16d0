"""Run now: a fire outside a schedule's trigger, which the leader publishes within a
poll (storage/operations.py ``trigger`` records the request)."""

from __future__ import annotations

import re
from urllib.parse import quote

import structlog
from aiohttp import web

from hascheduler.api.access import Action
from hascheduler.api.context import cluster_of, context
from hascheduler.api.errors import BadRequest
from hascheduler.api.guards import SCHEDULE, Guard
from hascheduler.api.middleware import change_by
from hascheduler.api.openapi import IDEMPOTENCY_KEY_HEADER, WRITE, json_body, responses
from hascheduler.api.params import as_json, now_of, read_optional_json
from hascheduler.api.route import Route
from hascheduler.core import models
from hascheduler.core.celery_message import CeleryPayloadError, celery_call, celery_task
from hascheduler.core.constants import MAX_IDEMPOTENCY_KEY_CHARS
from hascheduler.core.errors import RunConflict
from hascheduler.core.fanout import FanOut
from hascheduler.process import tracing
from hascheduler.storage import operations

log = structlog.get_logger("hascheduler.api")


_IDEMPOTENCY_KEY = re.compile(rf"[\x21-\x7e]{{1,{MAX_IDEMPOTENCY_KEY_CHARS}}}")


async def trigger_schedule(request: web.Request) -> web.Response:
    """Run a schedule now: a fire ``<id>@manual-<instant>`` the leader publishes within a
    poll (REQUESTED_POLL_S); an Idempotency-Key makes a retried request answer with the
    first one's fire."""
    cluster = cluster_of(request)
    wanted = models.TriggerIn.model_validate(await read_optional_json(request))
    key = request.headers.get("Idempotency-Key")
    if key is not None and not _IDEMPOTENCY_KEY.fullmatch(key):
        raise BadRequest(
            422,
            "Idempotency-Key",
            "Idempotency-Key must be 1 to "
            f"{MAX_IDEMPOTENCY_KEY_CHARS} printable ASCII characters, no spaces",
        )
    schedule = await context(request).store.get(request.match_info["id"])
    who = change_by(request, schedule.namespace)
    if wanted.payload is not None and celery_task(schedule.target) is not None:
        try:
            celery_call(wanted.payload)
        except CeleryPayloadError as exc:
            raise BadRequest(422, "payload", str(exc)) from None
    fire, created = await operations.trigger(
        cluster.ledger,
        schedule,
        wanted,
        who,
        now_of(request),
        key,
        lambda fan_out: _tenants_now(request, fan_out),
        tracing.current_traceparent(),
    )
    log.info("fire_requested", fire_id=fire, schedule_id=schedule.id, by=who.name, created=created)
    return as_json(
        models.Triggered(fire_id=fire, url=f"/fires/{quote(fire, safe='@:')}", created=created), 202
    )


async def _tenants_now(request: web.Request, fan_out: FanOut) -> list[str]:
    """A fan-out run now fires once per tenant its filter selects now (read from its
    source, not a mirror), within the cluster's bound."""
    bounded = context(request).fan_out
    if bounded is None:
        raise web.HTTPServiceUnavailable(reason="this replica reads no fan-out sources")
    limit, reads = bounded
    keys = await reads.keys(fan_out, limit)
    if keys is None:
        raise RunConflict(
            f"the fan-out selects more than {limit} documents of "
            f"{fan_out.collection!r} now; the cluster's bound is "
            "serve --max-fan-out"
        )
    if not keys:
        raise RunConflict(
            f"the fan-out selects no tenant of {fan_out.collection!r} now: nothing to run"
        )
    return keys


ROUTES: list[Route] = [
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
]
