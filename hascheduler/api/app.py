"""Routes: schedules CRUD, pause/resume, previews, health, readiness, OpenAPI."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import math
import re
import secrets
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import structlog
from aiohttp import web
from pydantic import BaseModel

from hascheduler.api.access import (
    AccessFile,
    Action,
    Denied,
    Grant,
    WriteLimiter,
    authenticate,
    refusal,
)
from hascheduler.api.errors import BadRequest, Forbidden, problem
from hascheduler.api.openapi import IF_MATCH, LABEL_FILTER
from hascheduler.api.views import (
    TIMELINE_MAX_HOURS,
    fan_out_fire,
    fire_groups,
    fire_view,
    read_dashboard,
    read_timeline,
    shown_time,
)
from hascheduler.brokers.base import Broker
from hascheduler.core import history, models
from hascheduler.core.celery_message import CeleryPayloadError, celery_call, celery_task
from hascheduler.core.clock import ServerClock
from hascheduler.core.constants import (
    DEFAULT_MAX_BACKFILL,
    DEFAULT_PAGE,
    HEARTBEAT_INTERVAL_S,
    LEASE_NAME,
    MAX_IDEMPOTENCY_KEY_CHARS,
    MAX_PAGE,
    MAX_PREVIEW,
)
from hascheduler.core.entries import Entry
from hascheduler.core.errors import RunConflict, ScheduleNotFound
from hascheduler.core.fanout import FanOut
from hascheduler.core.history import MAX_REASON_CHARS, Actor
from hascheduler.core.instants import as_utc
from hascheduler.core.overlap import ALLOW
from hascheduler.core.run_states import STATES
from hascheduler.core.triggers import count_between, fire_id, fire_times, just_before
from hascheduler.process import tracing
from hascheduler.process.metrics import CONTENT_TYPE, Metrics
from hascheduler.storage.audit_log import AuditLog, with_record
from hascheduler.storage.backfills import Backfill, Backfills
from hascheduler.storage.fires import (
    BUFFERED,
    REQUESTED,
    Ledger,
    request_documents,
    requested_fire,
)
from hascheduler.storage.health import HealthReader
from hascheduler.storage.lease import LeaseCollection, read_lease
from hascheduler.storage.members import Members
from hascheduler.storage.runs import FireRef, RunLedger, open_key, public_view
from hascheduler.storage.schedules import ScheduleStore
from hascheduler.storage.webhooks import Deliveries, WebhookExists, WebhookStore

# The dashboard's page: one static file, no build step, read once at import.
UI_PAGE = (Path(__file__).parent / "ui.html").read_text()
# Everything the page needs is inline or same-origin; nothing else may load or run.
UI_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
          "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
          "frame-ancestors 'none'")

Clock = Callable[[], dt.datetime]

STORE = web.AppKey("store", ScheduleStore)

log = structlog.get_logger("hascheduler.api")


class Mirror(Protocol):
    """The replica's schedules mirror (replica/mirror.py), as the API reads it."""

    @property
    def entries(self) -> Mapping[str, Entry]: ...
    @property
    def recently_applied(self) -> Mapping[str, float]: ...

    def status(self) -> dict[str, Any]: ...


MIRROR: web.AppKey[Mirror] = web.AppKey("mirror")
REPLICA = web.AppKey("replica_id", str)
CLOCK: web.AppKey[Clock] = web.AppKey("clock")
MIN_FIRE_INTERVAL: web.AppKey[float] = web.AppKey("min_fire_interval_s")
METRICS = web.AppKey("metrics", Metrics)
ACCESS = web.AppKey("access", AccessFile)
LIMITER = web.AppKey("write_limiter", WriteLimiter)
class TenantReads(Protocol):
    """What a fan-out selects now (storage/tenants.TenantDocuments)."""

    async def count(self, fan_out: FanOut, limit: int) -> int: ...
    async def keys(self, fan_out: FanOut, limit: int) -> list[str] | None: ...


# The bound on a fan-out's tenants, and how to read what one selects.
FAN_OUT: web.AppKey[tuple[int, TenantReads]] = web.AppKey("fan_out")


class SourceMirrors(Protocol):
    """The replica's fan-out source mirrors (tenants.Sources), for /readyz."""

    @property
    def ready(self) -> bool: ...
    def digests(self) -> dict[str, str]: ...


SOURCES: web.AppKey[SourceMirrors] = web.AppKey("sources")
SERVER_CLOCK: web.AppKey[ServerClock] = web.AppKey("server_clock")
TRACE_URL: web.AppKey[str | None] = web.AppKey("trace_url")


WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Where a route's namespace comes from (Guard.scope).
SCHEDULE = "schedule"  # the path's id is a schedule's
FIRE = "fire"  # the path's id is a fire's (or its run's): <schedule id>@...
BACKFILL = "backfill"  # the path's id is a backfill's
WEBHOOK = "webhook"  # the path's id is a webhook's
BODY = "body"  # the body names it: the handler checks each (require)
LISTING = "listing"  # a list: the handler reads only namespaces the grant reaches
CLUSTER_WIDE = "cluster"  # the cluster's own state: no namespace


@dataclass(frozen=True)
class Guard:
    """Who may call a route: the action it needs (None: anyone, no token) and where the
    namespace the action applies to comes from."""

    action: Action | None
    scope: str = CLUSTER_WIDE


GUARDS: web.AppKey[dict[tuple[str, str], Guard]] = web.AppKey("guards")
GRANT = web.RequestKey("grant", Grant)
UNKNOWN_NAMESPACE = "(unknown: its schedule no longer exists)"


def _denied(denied: Denied) -> web.Response:
    response = problem(denied.status, denied.title)
    response.headers.update(denied.headers)
    return response


async def _resource_namespace(request: web.Request, scope: str) -> str | None:
    """The namespace of the resource the path names; None when it names none that exists
    (for a schedule the handler then answers 404)."""
    resource = request.match_info["id"]
    if scope == WEBHOOK:
        found = await _webhooks(request)[0].get(resource)
        return str(found["namespace"]) if found is not None else None
    if scope == BACKFILL:
        cluster = request.app.get(CLUSTER)
        backfills = cluster.backfills if cluster is not None else None
        doc = await backfills.get(resource) if backfills is not None else None
        if doc is None:
            return None
        resource = str(doc["schedule_id"])
    elif scope == FIRE:
        resource = resource.partition("@")[0]
    return await request.app[STORE].namespace_of(resource)


@web.middleware
async def access_control(request: web.Request, handler: Any) -> web.StreamResponse:
    """The grant first (a stranger learns nothing, not even a rate), its action and
    namespace, then the write limit. The route table gives every route its guard, so a
    route cannot be added unguarded (tests/test_access_matrix.py)."""
    route = request.match_info.route.resource
    guard = request.app[GUARDS].get((request.method, route.canonical)) \
        if route is not None else None
    if guard is None or guard.action is None:
        answer: web.StreamResponse = await handler(request)
        return answer
    grant = authenticate(request.app[ACCESS].current, request.headers.get("Authorization"))
    if isinstance(grant, Denied):
        return _denied(grant)
    request[GRANT] = grant
    if not grant.can(guard.action):
        raise Forbidden(refusal(grant, guard.action, None).title, guard.action, None)
    if guard.scope in (SCHEDULE, FIRE, BACKFILL, WEBHOOK) and not grant.everywhere:
        namespace = await _resource_namespace(request, guard.scope)
        if namespace is None and guard.scope not in (SCHEDULE, WEBHOOK):
            raise Forbidden(refusal(grant, guard.action, UNKNOWN_NAMESPACE).title,
                            guard.action, None)
        if namespace is not None:
            require(request, guard.action, namespace)
    if request.method in WRITE_METHODS:
        client = request.remote or "unknown"
        wait = request.app[LIMITER].take(client)
        if wait > 0:
            limit = request.app[LIMITER].limit
            response = problem(429, f"too many writes from {client}: at most "
                                    f"{limit.per_second:g} per second (bursts of {limit.burst});"
                                    f" retry after {wait:.2f} s")
            response.headers["Retry-After"] = str(math.ceil(wait))
            return response
    answer = await handler(request)
    if request.method in WRITE_METHODS:
        request.app[AUDIT].wake()  # a change's record is pending: copy it soon
    return answer


# The query parameters each route takes, by (method, route template): from the route
# table's OpenAPI operations, so what is served and what is documented are one list.
QUERY: web.AppKey[dict[tuple[str, str], frozenset[str]]] = web.AppKey("query")


@web.middleware
async def known_query(request: web.Request, handler: Any) -> web.StreamResponse:
    """A query parameter the route does not take is refused with 400 naming it: ignored,
    ``GET /runs?schedule=X`` answered every schedule's runs as if filtered."""
    route = request.match_info.route.resource
    known = request.app[QUERY].get((request.method, route.canonical)) \
        if route is not None else None
    if known is not None:
        unknown = sorted(set(request.query) - known)
        if unknown:
            takes = ", ".join(sorted(known)) or "none"
            raise BadRequest(400, unknown[0], f"unknown query parameter {unknown[0]!r}; "
                                              f"this route takes: {takes}")
    answer: web.StreamResponse = await handler(request)
    return answer


def grant_of(request: web.Request) -> Grant:
    grant: Grant = request[GRANT]
    return grant


def require(request: web.Request, action: Action, namespace: str) -> None:
    """Raises Forbidden unless the caller may ``action`` in ``namespace``."""
    grant = grant_of(request)
    if not grant.allows(action, namespace):
        raise Forbidden(refusal(grant, action, namespace).title, action, namespace)


def readable_namespaces(request: web.Request) -> list[str] | None:
    """The namespaces a list may show: the one asked for (?namespace=, which the caller
    must reach), else every one the caller reaches (None: all)."""
    asked = request.query.get("namespace")
    grant = grant_of(request)
    if asked is not None:
        if not models.NAMESPACE.fullmatch(asked):
            raise BadRequest(422, "namespace", "namespace must be a DNS label: lowercase "
                                               "letters, digits or '-'")
        require(request, Action.READ, asked)
        return [asked]
    return None if grant.everywhere else sorted(grant.namespaces)


def actor(request: web.Request) -> Actor:
    """Who is asking, from where, and why (X-Reason), for the audit trail."""
    reason = request.headers.get("X-Reason")
    if reason is not None and (len(reason) > MAX_REASON_CHARS or not reason.strip()):
        raise BadRequest(422, "X-Reason", f"X-Reason is 1 to {MAX_REASON_CHARS} characters")
    return Actor(grant_of(request).name, request.remote, reason,
                 request.headers.get("X-Change-Origin"))


def _change_by(request: web.Request, namespace: str, given: Actor | None = None) -> Actor:
    """``actor``, refused (422 naming X-Reason) where the namespace requires a reason."""
    who = given or actor(request)
    if who.reason is None and request.app[ACCESS].current.rules_of(namespace).require_reason:
        raise BadRequest(422, "X-Reason", f"namespace {namespace!r} requires a reason for "
                                          "every change: send it in the X-Reason header")
    return who


@web.middleware
async def observe_requests(request: web.Request, handler: Any) -> web.StreamResponse:
    """Requests by route template (not path: ids would explode the label set) and status;
    with tracing on, each a server span continuing the caller's ``traceparent`` (the
    schedule write or the fire run now it makes nests in it)."""
    route = request.match_info.route.resource
    name = route.canonical if route is not None else "unmatched"
    status = 500
    with _server_span(request, name) as span:
        try:
            response: web.StreamResponse = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            request.app[METRICS].http.labels(name, request.method, str(status)).inc()
            if span is not None:
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(tracing.Status(tracing.StatusCode.ERROR))


@contextlib.contextmanager
def _server_span(request: web.Request, route: str) -> Iterator[tracing.Span | None]:
    if not tracing.enabled():
        yield None
        return
    parent = tracing.context_of(request.headers.get("traceparent"),
                                request.headers.get("tracestate"))
    with tracing.tracer().start_as_current_span(
            f"{request.method} {route}", context=parent, kind=tracing.SpanKind.SERVER,
            attributes={"http.request.method": request.method, "http.route": route,
                        "url.path": request.path}) as span:
        yield span


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

_JSON_TYPES = {"application/json", "application/merge-patch+json"}


def _json(model: BaseModel, status: int = 200, **headers: str) -> web.Response:
    return web.Response(text=model.model_dump_json(), status=status,
                        content_type="application/json", headers=headers)


def _schedule_response(schedule: models.Schedule, status: int = 200,
                       **headers: str) -> web.Response:
    return _json(schedule, status, ETag=f'"{schedule.revision}"', **headers)


async def _body(request: web.Request) -> dict[str, Any]:
    if request.content_type not in _JSON_TYPES:
        raise BadRequest(415, "Content-Type", "send the body as application/json")
    raw = await request.read()
    try:
        body = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(400, "body", f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(422, "body", "the body must be a JSON object")
    return body


async def _optional_body(request: web.Request) -> dict[str, Any]:
    """``_body``, or {} for a request sent without one."""
    return await _body(request) if (await request.read()).strip() else {}


def _expected_revision(request: web.Request) -> int | None:
    header = request.headers.get("If-Match")
    if header is None:
        return None
    match = IF_MATCH.fullmatch(header)
    if match is None:
        raise BadRequest(400, "If-Match", "If-Match must be a schedule revision, as the "
                                          "ETag header gives it (for example \"3\"), or *")
    return int(match[1]) if match[1] else None


def _int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    if not text.lstrip("-").isdigit() or not low <= int(text) <= high:
        raise BadRequest(422, name, f"{name} must be a whole number from {low} to {high}")
    return int(text)


def _bool_param(request: web.Request, name: str) -> bool | None:
    text = request.query.get(name)
    if text is None:
        return None
    if text.lower() not in {"true", "false"}:
        raise BadRequest(422, name, f"{name} must be true or false")
    return text.lower() == "true"


def _time_param(request: web.Request, name: str, default: dt.datetime) -> dt.datetime:
    text = request.query.get(name)
    if text is None:
        return default
    try:
        return models.parse_instant(text)
    except ValueError as exc:
        raise BadRequest(422, name, f"{name} {exc}") from None


def _now(request: web.Request) -> dt.datetime:
    clock: Clock = request.app[CLOCK]
    return clock()


def _validate(request: web.Request, model: type[BaseModel], data: dict[str, Any],
              now: dt.datetime, stored_trigger: bool = False) -> Any:
    return model.model_validate(data, context={
        "now": now, "stored": stored_trigger,
        "min_fire_interval_s": request.app[MIN_FIRE_INTERVAL]})


async def _check_fan_out(request: web.Request, fields: models.ScheduleFields) -> None:
    """A fan-out selecting more tenants than the cluster's bound is refused when written
    (422 on fan_out); counting stops one past the bound, so the check costs what it may."""
    if fields.fan_out is None or FAN_OUT not in request.app:
        return
    limit, tenants = request.app[FAN_OUT]
    quota = request.app[ACCESS].current.rules_of(fields.namespace).max_fan_out
    bound = ("the cluster's bound is serve --max-fan-out" if quota is None or quota >= limit
             else f"namespace {fields.namespace!r} has a max_fan_out quota of {quota}")
    limit = limit if quota is None else min(limit, quota)
    selected = await tenants.count(fields.fan_out, limit + 1)
    if selected > limit:
        raise BadRequest(422, "fan_out", f"the filter selects more than {limit} documents "
                                         f"of {fields.fan_out.collection!r}; {bound}")


async def _check_quota(request: web.Request, namespace: str, adding: int) -> None:
    """A namespace at its max_schedules takes no more (422 naming the quota)."""
    limit = request.app[ACCESS].current.rules_of(namespace).max_schedules
    if limit is not None and await request.app[STORE].count(namespace) + adding > limit:
        raise BadRequest(422, "namespace", f"namespace {namespace!r} holds at most {limit} "
                                           "schedules (its max_schedules quota)")


async def create_schedule(request: web.Request) -> web.Response:
    body = await _body(request)
    now = _now(request)
    new = _validate(request, models.ScheduleIn, body, now)
    require(request, Action.WRITE, new.namespace)
    who = _change_by(request, new.namespace)
    await _check_quota(request, new.namespace, 1)
    await _check_fan_out(request, new)
    schedule = await request.app[STORE].create(new, now, who)
    return _schedule_response(schedule, 201, Location=f"/schedules/{schedule.id}")


async def create_schedules(request: web.Request) -> web.Response:
    """Many schedules in one round trip (``hascheduler apply``): every one is checked
    first, as POST /schedules checks it; nothing is written unless all are valid. An id
    already taken is left as it was and answered in ``existing``."""
    body = await _body(request)
    now = _now(request)
    batch = _validate(request, models.ScheduleBatchIn, body, now)
    who = actor(request)
    added: dict[str, int] = {}
    for new in batch.schedules:
        added[new.namespace] = added.get(new.namespace, 0) + 1
    for namespace, count in sorted(added.items()):
        require(request, Action.WRITE, namespace)
        _change_by(request, namespace, who)
        await _check_quota(request, namespace, count)
    for new in batch.schedules:
        await _check_fan_out(request, new)
    created, existing = await request.app[STORE].create_many(batch.schedules, now, who)
    return _json(models.BatchCreated(created=created, existing=existing))


async def list_schedules(request: web.Request) -> web.Response:
    labels: dict[str, str] = {}
    for value in request.query.getall("label", []):
        if not re.match(LABEL_FILTER, value):
            raise BadRequest(422, "label", "label filters look like label=key=value")
        key, _, text = value.partition("=")
        labels[key] = text
    items, after = await request.app[STORE].list(
        labels=labels, paused=_bool_param(request, "paused"),
        after=request.query.get("after"),
        limit=_int_param(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE),
        namespaces=readable_namespaces(request))
    health = None
    if _bool_param(request, "health"):
        found = await _cluster(request).health.many(items, _now(request))
        health = {h.schedule_id: h for h in found}
    return _json(models.ScheduleList(items=items, next=after, health=health))


async def schedule_health(request: web.Request) -> web.Response:
    """Its last fire, last success, consecutive failures, lateness against its own trigger
    and its objective (core/health.py)."""
    schedule = await request.app[STORE].get(request.match_info["id"])
    return _json(await _cluster(request).health.of(schedule, _now(request)))


async def get_schedule(request: web.Request) -> web.Response:
    return _schedule_response(await request.app[STORE].get(request.match_info["id"]))


async def put_schedule(request: web.Request) -> web.Response:
    body = await _body(request)
    if "id" in body and body["id"] != request.match_info["id"]:
        raise BadRequest(422, "id", "the id in the body differs from the one in the path")
    body.pop("id", None)
    now = _now(request)
    fields = _validate(request, models.ScheduleFields, body, now)
    who = await _writing(request, request.match_info["id"], fields.namespace)
    await _check_fan_out(request, fields)
    schedule = await request.app[STORE].replace(request.match_info["id"], fields, now,
                                                _expected_revision(request), who)
    return _schedule_response(schedule)


async def _schedule_actor(request: web.Request, schedule_id: str,
                          given: Actor | None = None) -> Actor:
    """``actor`` (or ``given``) for a change to a stored schedule, refused without the
    reason its namespace may require (read only when some namespace requires one)."""
    who = given or actor(request)
    rules = request.app[ACCESS].current.rules
    if who.reason is None and any(r.require_reason for r in rules.values()):
        namespace = await request.app[STORE].namespace_of(schedule_id)
        if namespace is not None:
            _change_by(request, namespace, who)
    return who


async def _writing(request: web.Request, schedule_id: str, namespace: str) -> Actor:
    """A replacement of a schedule's fields, which may move it to ``namespace``: the
    caller must reach that namespace too, and its quota and rules apply."""
    require(request, Action.WRITE, namespace)
    who = _change_by(request, namespace, await _schedule_actor(request, schedule_id))
    if request.app[ACCESS].current.rules_of(namespace).max_schedules is not None and \
            await request.app[STORE].namespace_of(schedule_id) not in (namespace, None):
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
    patch = await _body(request)
    schedule_id = request.match_info["id"]
    for server_field in ("id", "created_at", "updated_at", "revision", "pause", "completed",
                         "fires_remaining"):
        if server_field in patch:
            raise BadRequest(422, server_field, f"{server_field} is set by the server")
    store = request.app[STORE]
    expected = _expected_revision(request)
    current = await store.get(schedule_id)
    client_fields = set(models.ScheduleFields.model_fields)
    merged = _merge_patch(current.model_dump(mode="json", include=client_fields), patch)
    now = _now(request)
    fields = _validate(request, models.ScheduleFields, merged, now,
                       stored_trigger="trigger" not in patch)
    who = await _writing(request, schedule_id, fields.namespace)
    await _check_fan_out(request, fields)
    # Without If-Match, the revision read above still guards against a lost update.
    schedule = await store.replace(schedule_id, fields, now,
                                   expected if expected is not None else current.revision, who)
    return _schedule_response(schedule)


async def delete_schedule(request: web.Request) -> web.Response:
    schedule_id = request.match_info["id"]
    await request.app[STORE].delete(schedule_id, _expected_revision(request),
                                    await _schedule_actor(request, schedule_id), _now(request))
    return web.Response(status=204)


async def pause_schedule(request: web.Request) -> web.Response:
    """Pause, with an optional note and an instant to resume at by itself."""
    now = _now(request)
    wanted = models.PauseIn.model_validate(await _optional_body(request),
                                           context={"now": now})
    schedule_id = request.match_info["id"]
    who = actor(request)
    if who.reason is None and wanted.note is not None:  # the pause's note says why
        who = dataclasses.replace(who, reason=wanted.note)
    who = await _schedule_actor(request, schedule_id, who)
    schedule = await request.app[STORE].pause(
        schedule_id, now, who, wanted.note, wanted.until, _expected_revision(request))
    return _schedule_response(schedule)


async def resume_schedule(request: web.Request) -> web.Response:
    schedule_id = request.match_info["id"]
    schedule = await request.app[STORE].resume(
        schedule_id, _now(request), _expected_revision(request),
        await _schedule_actor(request, schedule_id))
    return _schedule_response(schedule)


async def next_fires(request: web.Request) -> web.Response:
    count = _int_param(request, "count", 5, 1, MAX_PREVIEW)
    after = _time_param(request, "after", _now(request))
    schedule = await request.app[STORE].get(request.match_info["id"])
    # A thousand times of a rare expression take a quarter of a second to work out: off
    # the loop, which must keep renewing the lease meanwhile.
    return _json(await asyncio.to_thread(models.preview, schedule, after, count))


async def mirror_entry(request: web.Request) -> web.Response:
    """What this replica's mirror holds for one schedule (for comparing replicas)."""
    schedule_id = request.match_info["id"]
    mirror = request.app[MIRROR]
    entry = mirror.entries.get(schedule_id)
    if entry is None:
        return problem(404, f"schedule {schedule_id!r} is not in this replica's mirror",
                       replica_id=request.app[REPLICA])
    nominal = next(fire_times(entry.trigger, _now(request), limit=1), None)
    return web.json_response({
        "id": schedule_id, "revision": entry.revision, "paused": entry.paused,
        "next_nominal": nominal.isoformat() if nominal else None,
        "applied_at": mirror.recently_applied.get(schedule_id),
        "replica_id": request.app[REPLICA]})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive", "replica_id": request.app[REPLICA]})


async def readyz(request: web.Request) -> web.Response:
    status = request.app[MIRROR].status()
    status["replica_id"] = request.app[REPLICA]
    sources = request.app.get(SOURCES)
    if sources is not None:  # each fan-out source's mirror: equal digests, equal copies
        status["sources"] = sources.digests()
        status["sources_ready"] = sources.ready
    server_clock = request.app.get(SERVER_CLOCK)
    if server_clock is not None:  # a replica that may not lead says why (invariant 12)
        status["clock"] = server_clock.status()
    cluster = request.app.get(CLUSTER)
    if cluster is not None:
        status["unfit_to_lead"] = cluster.elector.unfit_reason
    return web.json_response(status, status=200 if status["ready"] else 503)


class Leading(Protocol):
    """Whether this replica leads now (the elector)."""

    @property
    def is_leader(self) -> bool: ...

    @property
    def unfit_reason(self) -> str | None: ...  # why it may not lead now, if so


class Cluster:
    """What the API reads about leadership, members and the fire ledger."""

    def __init__(self, leases: LeaseCollection, members: Members, ledger: Ledger,
                 elector: Leading, runs: RunLedger, broker: Broker,
                 backfills: Backfills | None = None,
                 max_backfill: int = DEFAULT_MAX_BACKFILL,
                 health: HealthReader | None = None,
                 webhooks: tuple[WebhookStore, Deliveries] | None = None) -> None:
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


CLUSTER: web.AppKey[Cluster] = web.AppKey("cluster")


def _cluster(request: web.Request) -> Cluster:
    cluster = request.app.get(CLUSTER)
    if cluster is None:
        raise web.HTTPServiceUnavailable(reason="leadership is not configured here")
    return cluster


async def _leader_view(request: web.Request, cluster: Cluster) -> dict[str, Any]:
    view = await read_lease(cluster.leases, LEASE_NAME)
    held = view is not None and view.held_at(_now(request))
    return {"holder": view.holder if held and view else None,
            "last_holder": view.holder if view else None, "term": view.term if view else 0,
            "expires_at": shown_time(view.expires_at) if view else None,
            "fired_through": shown_time(view.fired_through) if view else None,
            "answered_by": request.app[REPLICA],
            "answered_by_leader": bool(cluster.elector.is_leader)}


async def leader(request: web.Request) -> web.Response:
    """The lease as the database holds it, and which replica answered."""
    return web.json_response(await _leader_view(request, _cluster(request)))


async def _members_view(request: web.Request, cluster: Cluster) -> list[dict[str, Any]]:
    now = _now(request)
    fresh = now - dt.timedelta(seconds=3 * HEARTBEAT_INTERVAL_S)
    # The leader is the live lease's holder: a heartbeat only says what its replica
    # believed when it was sent, and a departed leader's last one said so.
    view = await read_lease(cluster.leases, LEASE_NAME)
    holder = view.holder if view is not None and view.held_at(now) else None
    out = []
    for doc in await cluster.members.seen_since(fresh):
        out.append({"replica_id": doc["_id"], "url": doc.get("url"), "ready": doc.get("ready"),
                    "size": doc.get("size"), "digest": doc.get("digest"),
                    "leader": doc["_id"] == holder, "term": doc.get("term"),
                    "seen_at": shown_time(doc.get("seen_at"))})
    return out


async def members(request: web.Request) -> web.Response:
    return web.json_response({"members": await _members_view(request, _cluster(request)),
                              "answered_by": request.app[REPLICA]})


async def fire_history(request: web.Request) -> web.Response:
    cluster = _cluster(request)
    schedule_id = request.match_info["id"]
    await request.app[STORE].get(schedule_id)  # 404 for a schedule that does not exist
    limit = _int_param(request, "limit", 50, 1, MAX_PAGE)
    items = [fire_view(doc) for doc in await cluster.ledger.history(schedule_id, limit)]
    return web.json_response({"schedule_id": schedule_id, "items": items})


async def schedule_runs(request: web.Request) -> web.Response:
    cluster = _cluster(request)
    schedule_id = request.match_info["id"]
    await request.app[STORE].get(schedule_id)  # 404 for a schedule that does not exist
    limit = _int_param(request, "limit", 50, 1, MAX_PAGE)
    by = request.query.get("by")
    if by not in (None, "fire"):
        raise BadRequest(422, "by", "by must be fire (runs counted per fire) or absent")
    if by == "fire":
        nominals = await cluster.ledger.fire_times(schedule_id, limit)
        groups = await fire_groups(cluster.ledger, cluster.runs, schedule_id, nominals)
        return web.json_response({"schedule_id": schedule_id, "fires": groups})
    docs = await cluster.runs.for_schedule(schedule_id, limit)
    return web.json_response({"schedule_id": schedule_id,
                              "items": [public_view(d) for d in docs]})


async def list_runs(request: web.Request) -> web.Response:
    cluster = _cluster(request)
    state = request.query.get("state")
    if state is not None and state not in STATES:
        raise BadRequest(422, "state", f"state must be one of {', '.join(STATES)}")
    limit = _int_param(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
    namespaces = readable_namespaces(request)
    ids = None if namespaces is None else await request.app[STORE].ids_in(namespaces)
    try:
        docs, after = await cluster.runs.page(state, request.query.get("after"), limit, ids)
    except LookupError:
        return problem(404, "after names no run (it may have expired): list from the start")
    return web.json_response({"items": [public_view(d) for d in docs], "next": after})


async def get_run(request: web.Request) -> web.Response:
    doc = await _cluster(request).runs.get(request.match_info["id"])
    if doc is None:
        return problem(404, f"no run for fire {request.match_info['id']!r}")
    return web.json_response(public_view(doc))


async def retry_run(request: web.Request) -> web.Response:
    """Replay a dead run (RunLedger.replay_dead); under its schedule's overlap policy, not
    beside another open run of the same key (409)."""
    cluster = _cluster(request)
    fire = request.match_info["id"]
    run = await cluster.runs.get(fire)
    key, record = None, None
    if run is not None:
        schedule_id, namespace = str(run["schedule_id"]), UNKNOWN_NAMESPACE
        with contextlib.suppress(ScheduleNotFound):
            schedule = await request.app[STORE].get(schedule_id)
            namespace = schedule.namespace
            if schedule.overlap != ALLOW:
                key = open_key(schedule.id, run.get("tenant"))
        record = _record(request, history.RETRY, _change_by(request, namespace), namespace,
                         schedule_id, {"fire_id": fire})
    doc = await cluster.runs.replay_dead(fire, _now(request), cluster.broker, key, record)
    return web.json_response(public_view(doc), status=202)


def _record(request: web.Request, action: str, who: Actor, namespace: str,
            schedule_id: str, detail: dict[str, Any]) -> dict[str, Any]:
    """The audit record of a change to a schedule's runs (the schedule stays as it is)."""
    return history.record(action, who, _now(request), namespace, schedule_id, None,
                          detail=detail)


_IDEMPOTENCY_KEY = re.compile(rf"[\x21-\x7e]{{1,{MAX_IDEMPOTENCY_KEY_CHARS}}}")


async def trigger_schedule(request: web.Request) -> web.Response:
    """Run a schedule now: a fire ``<id>@manual-<instant>`` the leader publishes within a
    poll (REQUESTED_POLL_S); an Idempotency-Key makes a retried request answer with the
    first one's fire."""
    cluster = _cluster(request)
    wanted = models.TriggerIn.model_validate(await _optional_body(request))
    key = request.headers.get("Idempotency-Key")
    if key is not None and not _IDEMPOTENCY_KEY.fullmatch(key):
        raise BadRequest(422, "Idempotency-Key", "Idempotency-Key must be 1 to "
                         f"{MAX_IDEMPOTENCY_KEY_CHARS} printable ASCII characters, no spaces")
    schedule = await request.app[STORE].get(request.match_info["id"])
    who = _change_by(request, schedule.namespace)
    if (schedule.paused or schedule.completed) and not wanted.force:
        state = "paused" if schedule.paused else "completed (its max_fires are used)"
        raise RunConflict(f"schedule {schedule.id!r} is {state}; send \"force\": true to "
                          "run it anyway")
    if wanted.payload is not None and celery_task(schedule.target) is not None:
        try:
            celery_call(wanted.payload)
        except CeleryPayloadError as exc:
            raise BadRequest(422, "payload", str(exc)) from None
    earlier = None if key is None else await cluster.ledger.requested_with_key(
        f"{schedule.id}/{key}")
    if earlier is not None:
        doc, created = earlier, False
    else:
        tenants = None if schedule.fan_out is None else await _tenants_now(
            request, schedule.fan_out)
        docs = request_documents(schedule.id, _now(request), who.name, wanted.payload,
                                 wanted.overlap, key, tenants, tracing.current_traceparent(),
                                 wanted.priority)
        docs[0] = with_record(docs[0], _record(
            request, history.TRIGGER, who, schedule.namespace, schedule.id,
            {"fire_id": requested_fire(docs[0]), "force": wanted.force,
             "overlap": wanted.overlap, "payload_given": wanted.payload is not None,
             "tenants": len(tenants) if tenants is not None else None}))
        doc, created = await cluster.ledger.request(docs)
    fire = requested_fire(doc)
    log.info("fire_requested", fire_id=fire, schedule_id=schedule.id, by=who.name,
             created=created)
    return _json(models.Triggered(fire_id=fire, url=f"/fires/{quote(fire, safe='@:')}",
                                  created=created), 202)


async def _tenants_now(request: web.Request, fan_out: FanOut) -> list[str]:
    """A fan-out run now fires once per tenant its filter selects now (read from its
    source, not a mirror), within the cluster's bound."""
    if FAN_OUT not in request.app:
        raise web.HTTPServiceUnavailable(reason="this replica reads no fan-out sources")
    limit, reads = request.app[FAN_OUT]
    keys = await reads.keys(fan_out, limit)
    if keys is None:
        raise RunConflict(f"the fan-out selects more than {limit} documents of "
                          f"{fan_out.collection!r} now; the cluster's bound is "
                          "serve --max-fan-out")
    if not keys:
        raise RunConflict(f"the fan-out selects no tenant of {fan_out.collection!r} now: "
                          "nothing to run")
    return keys


def _backfills(request: web.Request) -> Backfills:
    backfills = _cluster(request).backfills
    if backfills is None:
        raise web.HTTPServiceUnavailable(reason="this replica keeps no backfills")
    return backfills


async def backfill_schedule(request: web.Request) -> web.Response:
    """Fire the schedule's nominal times in [start, end) the ledger has no fire for, worked
    by the leader (storage/backfills.py)."""
    cluster = _cluster(request)
    backfills = _backfills(request)
    now = _now(request)
    wanted = models.BackfillIn.model_validate(await _body(request), context={"now": now})
    schedule = await request.app[STORE].get(request.match_info["id"])
    who = _change_by(request, schedule.namespace)
    if schedule.paused:
        raise RunConflict(f"schedule {schedule.id!r} is paused; resume it to backfill")
    total = count_between(schedule.compile(), just_before(wanted.start),
                          just_before(wanted.end))
    if total > cluster.max_backfill:
        raise BadRequest(422, "end", f"the range holds {total} fire times; a backfill fires "
                                     f"at most {cluster.max_backfill} (serve --max-backfill)")
    doc = await backfills.create(
        schedule.id, wanted.start, wanted.end, wanted.overlap, total, who.name, now,
        _record(request, history.BACKFILL, who, schedule.namespace, schedule.id,
                {"start": shown_time(wanted.start), "end": shown_time(wanted.end),
                 "total": total, "overlap": wanted.overlap}))
    return _json(Backfill.of(doc), 202, Location=f"/backfills/{doc['_id']}")


# Every event of a namespace is one delivery per webhook: the number is bounded.
MAX_WEBHOOKS_PER_NAMESPACE = 50


def _webhooks(request: web.Request) -> tuple[WebhookStore, Deliveries]:
    webhooks = _cluster(request).webhooks
    if webhooks is None:
        raise web.HTTPServiceUnavailable(reason="webhooks are not configured here")
    return webhooks


def _webhook_view(doc: dict[str, Any], secret: str | None = None) -> models.Webhook:
    return models.Webhook(id=doc["_id"], url=doc["url"], events=doc["events"],
                          namespace=doc["namespace"], schedule_id=doc.get("schedule_id"),
                          created_at=as_utc(doc["created_at"]), secret=secret)


async def create_webhook(request: web.Request) -> web.Response:
    """A webhook in a namespace (admin there): its secret is in this answer, never again."""
    store, _ = _webhooks(request)
    wanted = models.WebhookIn.model_validate(await _body(request))
    require(request, Action.ADMIN, wanted.namespace)
    if wanted.schedule_id is not None:
        namespace = await request.app[STORE].namespace_of(wanted.schedule_id)
        if namespace != wanted.namespace:
            raise BadRequest(422, "schedule_id", f"no schedule {wanted.schedule_id!r} in "
                                                 f"namespace {wanted.namespace!r}")
    if len(await store.in_namespaces([wanted.namespace])) >= MAX_WEBHOOKS_PER_NAMESPACE:
        raise BadRequest(409, "namespace", f"namespace {wanted.namespace!r} has "
                         f"{MAX_WEBHOOKS_PER_NAMESPACE} webhooks already, the most it may: "
                         "each event is delivered to each of them")
    secret = wanted.secret or secrets.token_urlsafe(32)
    doc = {"_id": wanted.id or uuid.uuid4().hex, "url": wanted.url, "events": wanted.events,
           "namespace": wanted.namespace, "schedule_id": wanted.schedule_id,
           "secret": secret, "created_at": _now(request), "created_by": grant_of(request).name}
    try:
        await store.create(doc)
    except WebhookExists:
        raise BadRequest(409, "id", f"a webhook {doc['_id']!r} exists") from None
    log.info("webhook_created", webhook=doc["_id"], namespace=wanted.namespace,
             events=wanted.events, by=doc["created_by"])
    return _json(_webhook_view(doc, secret), 201)


async def list_webhooks(request: web.Request) -> web.Response:
    store, _ = _webhooks(request)
    docs = await store.in_namespaces(readable_namespaces(request))
    return _json(models.WebhookList(items=[_webhook_view(d) for d in docs]))


async def _webhook(request: web.Request) -> dict[str, Any]:
    doc = await _webhooks(request)[0].get(request.match_info["id"])
    if doc is None:
        raise web.HTTPNotFound(reason=f"no webhook {request.match_info['id']!r}")
    return doc


async def get_webhook(request: web.Request) -> web.Response:
    return _json(_webhook_view(await _webhook(request)))


async def delete_webhook(request: web.Request) -> web.Response:
    store, deliveries = _webhooks(request)
    doc = await _webhook(request)
    await store.delete(doc["_id"])
    await deliveries.forget(doc["_id"])
    log.info("webhook_deleted", webhook=doc["_id"], by=grant_of(request).name)
    return web.Response(status=204)


async def webhook_deliveries(request: web.Request) -> web.Response:
    """A webhook's deliveries, newest first, each with its attempts."""
    doc = await _webhook(request)
    limit = _int_param(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
    items = [_delivery_view(d) for d in await _webhooks(request)[1].of(doc["_id"], limit)]
    return web.json_response({"items": items})


def _delivery_view(doc: dict[str, Any]) -> dict[str, Any]:
    def shown(value: Any) -> Any:
        return shown_time(as_utc(value)) if isinstance(value, dt.datetime) else value
    return {"id": doc["_id"], "event_id": doc["event_id"], "type": doc["type"],
            "schedule_id": doc.get("schedule_id"), "state": doc["state"],
            "attempts": doc["attempts"], "created_at": shown(doc["created_at"]),
            "next_at": shown(doc.get("next_at")) if doc["state"] == "pending" else None,
            "last_at": shown(doc.get("last_at")), "last_status": doc.get("last_status"),
            "last_error": doc.get("last_error"),
            "history": [{k: shown(v) for k, v in a.items()} for a in doc.get("history", [])]}


async def get_backfill(request: web.Request) -> web.Response:
    doc = await _backfills(request).get(request.match_info["id"])
    if doc is None:
        raise web.HTTPNotFound(reason=f"no backfill {request.match_info['id']!r}")
    return _json(Backfill.of(doc))


async def cancel_backfill(request: web.Request) -> web.Response:
    backfills = _backfills(request)
    current = await backfills.get(request.match_info["id"])
    if current is None:
        raise web.HTTPNotFound(reason=f"no backfill {request.match_info['id']!r}")
    schedule_id = str(current["schedule_id"])
    namespace = await request.app[STORE].namespace_of(schedule_id) or UNKNOWN_NAMESPACE
    doc = await backfills.cancel(current["_id"], _now(request), _record(
        request, history.CANCEL, _change_by(request, namespace), namespace, schedule_id,
        {"backfill_id": current["_id"]}))
    if doc is None:
        current = await backfills.get(current["_id"]) or current
        raise RunConflict(f"backfill {current['_id']!r} is {current['state']}; only a "
                          "running one can be cancelled")
    return _json(Backfill.of(doc))


async def get_fire(request: web.Request) -> web.Response:
    """One fire's ledger entry, with its run when it has one; a fan-out fire as counts of
    its tenants' entries and runs."""
    cluster = _cluster(request)
    fire = request.match_info["id"]
    doc = await cluster.ledger.get(fire)
    if doc is None:
        group = await fan_out_fire(cluster.ledger, cluster.runs, fire)
        if group is None:
            raise web.HTTPNotFound(reason=f"no fire {fire!r} in the ledger")
        return web.json_response(group)
    run = await cluster.runs.get(fire)
    return web.json_response({**fire_view(doc),
                              "run": public_view(run) if run is not None else None})


async def cancel_run(request: web.Request) -> web.Response:
    """Cancel a run (RunLedger.cancel): 200 when it ended now, 202 when its worker was
    asked to stop it (within a second). A fire published but not yet claimed by a worker
    is cancelled too; one still waiting (buffered, requested) is not published at all."""
    cluster = _cluster(request)
    fire_id_ = request.match_info["id"]
    schedule_id = fire_id_.partition("@")[0]
    namespace = await request.app[STORE].namespace_of(schedule_id) or UNKNOWN_NAMESPACE
    who = _change_by(request, namespace)
    now, by = _now(request), who.name
    ref = None
    fire = await cluster.ledger.get(fire_id_)
    if fire is not None and fire.get("state") not in ("skipped", "failed"):
        if fire["state"] in (BUFFERED, REQUESTED):
            await cluster.ledger.withdraw(fire_id_, f"cancelled by {by}")
        nominal, tenant = as_utc(fire["nominal_at"]), fire.get("tenant")
        ref = FireRef(fire_id_, fire["schedule_id"],
                      await _target_of(request, fire["schedule_id"]), nominal, {}, b"",
                      fire=fire_id(fire["schedule_id"], nominal) if tenant else "",
                      tenant=tenant)
    doc, ended = await cluster.runs.cancel(fire_id_, now, by, ref, _record(
        request, history.CANCEL, who, namespace, schedule_id, {"fire_id": fire_id_}))
    return web.json_response(public_view(doc), status=200 if ended else 202)


async def _target_of(request: web.Request, schedule_id: str) -> str:
    try:
        return (await request.app[STORE].get(schedule_id)).target
    except ScheduleNotFound:
        return ""


async def dashboard(request: web.Request) -> web.Response:
    """Everything /ui shows, in one read (views.read_dashboard) and the cluster's state."""
    cluster = _cluster(request)
    now = _now(request)
    view = await read_dashboard(request.app[STORE], cluster.ledger, cluster.runs, now,
                                readable_namespaces(request))
    return web.json_response({
        **view.as_json(), "now": now.isoformat(),
        "leader": await _leader_view(request, cluster),
        "members": await _members_view(request, cluster)})


async def timeline(request: web.Request) -> web.Response:
    """Each schedule's recent fires as marks, lateness over time, runs in flight
    (views.read_timeline)."""
    cluster = _cluster(request)
    text = request.query.get("hours", "1")
    try:
        hours = float(text)
    except ValueError:
        hours = math.nan
    if not 0.05 <= hours <= TIMELINE_MAX_HOURS:  # NaN fails this too
        raise BadRequest(422, "hours", f"hours must be a number from 0.05 to "
                                       f"{TIMELINE_MAX_HOURS:g}")
    schedule_id = request.query.get("schedule")
    namespaces = readable_namespaces(request)
    if schedule_id is not None:
        schedule = await request.app[STORE].get(schedule_id)
        require(request, Action.READ, schedule.namespace)
    view = await read_timeline(request.app[STORE], cluster.ledger, cluster.runs,
                               _now(request), hours, namespaces, schedule_id)
    return web.json_response({**view, "trace_url": request.app[TRACE_URL]})


async def whoami(request: web.Request) -> web.Response:
    grant = grant_of(request)
    return web.json_response({"name": grant.name,
                              "actions": sorted(a.value for a in grant.actions),
                              "namespaces": sorted(grant.namespaces)})


async def ui(request: web.Request) -> web.Response:
    return web.Response(text=UI_PAGE, content_type="text/html",
                        headers={"Cache-Control": "no-cache",
                                 "Content-Security-Policy": UI_CSP})


AUDIT = web.AppKey("audit", AuditLog)


async def audit_log(request: web.Request) -> web.Response:
    """The audit trail, newest first: ?namespace=&schedule=&actor=&since=&before=&limit=."""
    since = request.query.get("since")
    try:
        docs = await request.app[AUDIT].query(
            namespaces=readable_namespaces(request), schedule_id=request.query.get("schedule"),
            actor=request.query.get("actor"),
            since=None if since is None else _time_param(request, "since", _now(request)),
            before=request.query.get("before"),
            limit=_int_param(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE))
    except LookupError:
        return problem(404, "before names no record (it may have expired): list from the "
                            "start")
    items = [history.public(d) for d in docs]
    return web.json_response({"items": items, "next": items[-1]["id"] if len(items) ==
                              _int_param(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
                              else None})


async def schedule_history(request: web.Request) -> web.Response:
    """Every recorded change of one schedule, newest first (kept after it is deleted)."""
    schedule_id = request.match_info["id"]
    limit = _int_param(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
    try:
        docs = await request.app[AUDIT].query(namespaces=readable_namespaces(request),
                                              schedule_id=schedule_id,
                                              before=request.query.get("before"), limit=limit)
    except LookupError:
        return problem(404, "before names no record of this schedule")
    if not docs and request.query.get("before") is None:
        raise ScheduleNotFound(schedule_id)
    items = [history.public(d) for d in docs]
    return web.json_response({"schedule_id": schedule_id, "items": items,
                              "next": items[-1]["id"] if len(items) == limit else None})


async def restore_schedule(request: web.Request) -> web.Response:
    """Put a schedule's fields back as they were at an earlier revision (a new revision,
    recorded as a restore). A payload the trail keeps redacted stays as it is now."""
    schedule_id = request.match_info["id"]
    wanted = models.RestoreIn.model_validate(await _body(request))
    record = await request.app[AUDIT].revision(schedule_id, wanted.revision)
    if record is None:
        raise BadRequest(404, "revision", f"schedule {schedule_id!r} has no revision "
                                          f"{wanted.revision} in its history")
    store = request.app[STORE]
    current = await store.get(schedule_id)
    fields = {k: v for k, v in record["after"].items() if k not in ("pause", "completed")}
    if any(isinstance(v, str) and v.startswith("redacted:")
           for v in (fields.get("payload") or {}).values()):
        fields["payload"] = current.payload
    now = _now(request)
    restored = _validate(request, models.ScheduleFields, fields, now, stored_trigger=True)
    who = await _writing(request, schedule_id, restored.namespace)
    await _check_fan_out(request, restored)
    expected = _expected_revision(request)
    schedule = await store.replace(schedule_id, restored, now,
                                   expected if expected is not None else current.revision,
                                   dataclasses.replace(who, origin=None), history.RESTORE)
    return _schedule_response(schedule)
