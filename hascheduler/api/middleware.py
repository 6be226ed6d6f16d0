"""The API's middleware: access control (each route's guard from the route table: a
grant, its action and namespace, the write limit), unknown query parameters refused, and
requests observed (metrics, server spans); and who is asking, for the audit trail."""

from __future__ import annotations

import contextlib
import datetime as dt
import math
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from hascheduler.api.access import (
    Action,
    Denied,
    Grant,
    authenticate,
    refusal,
)
from hascheduler.api.context import context, webhooks_of
from hascheduler.api.errors import BadRequest, Forbidden, problem
from hascheduler.api.guards import BACKFILL, FIRE, SCHEDULE, WEBHOOK
from hascheduler.api.params import now_of
from hascheduler.core import fields, history
from hascheduler.core.errors import ScheduleNotFound
from hascheduler.core.history import MAX_REASON_CHARS, Actor
from hascheduler.process import tracing

WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
GRANT = web.RequestKey("grant", Grant)


def denied_response(denied: Denied) -> web.Response:
    response = problem(denied.status, denied.title)
    response.headers.update(denied.headers)
    return response


async def _resource_namespace(request: web.Request, scope: str) -> str | None:
    """The namespace of the resource the path names; None when it names none that exists
    (for a schedule the handler then answers 404)."""
    resource = request.match_info["id"]
    if scope == WEBHOOK:
        found = await webhooks_of(request)[0].get(resource)
        return str(found["namespace"]) if found is not None else None
    if scope == BACKFILL:
        cluster = context(request).cluster
        backfills = cluster.backfills if cluster is not None else None
        doc = await backfills.get(resource) if backfills is not None else None
        if doc is None:
            return None
        if isinstance(doc.get("namespace"), str):  # kept with it for life
            return str(doc["namespace"])
        resource = str(doc["schedule_id"])
    elif scope == FIRE:
        # A fire and its run keep their schedule's namespace for life: a schedule deleted,
        # or its id reused in another namespace, changes nothing about who reads them.
        cluster = context(request).cluster
        if cluster is not None:
            kept = await cluster.ledger.namespace_of(resource) or await cluster.runs.namespace_of(
                resource
            )
            if kept is not None:
                return kept
        resource = resource.partition("@")[0]
    return await context(request).store.namespace_of(resource)


def _not_found(scope: str, resource: str) -> Exception:
    """The 404 the route's handler answers for an id nobody used."""
    if scope == SCHEDULE:
        return ScheduleNotFound(resource)
    return web.HTTPNotFound(reason=f"no {scope} {resource!r}")


@web.middleware
async def access_control(request: web.Request, handler: Any) -> web.StreamResponse:
    """The grant first (a stranger learns nothing, not even a rate), its action and
    namespace, then the write limit. The route table gives every route its guard, so a
    route cannot be added unguarded (tests/test_access_matrix.py)."""
    route = request.match_info.route.resource
    guard = (
        context(request).guards.get((request.method, route.canonical))
        if route is not None
        else None
    )
    if guard is None or guard.action is None:
        answer: web.StreamResponse = await handler(request)
        return answer
    grant = authenticate(context(request).access.current, request.headers.get("Authorization"))
    if isinstance(grant, Denied):
        return denied_response(grant)
    request[GRANT] = grant
    if not grant.can(guard.action):
        raise Forbidden(refusal(grant, guard.action, None).title, guard.action, None)
    if guard.scope in (SCHEDULE, FIRE, BACKFILL, WEBHOOK) and not grant.everywhere:
        namespace = await _resource_namespace(request, guard.scope)
        if namespace not in grant.namespaces and (
            namespace is not None or guard.scope in (FIRE, BACKFILL)
        ):
            # What another namespace holds does not exist for this token: it answers as
            # an id nobody used does, so a token cannot learn what exists elsewhere.
            raise _not_found(guard.scope, request.match_info["id"])
        if namespace is not None:
            require(request, guard.action, namespace)
    if request.method in WRITE_METHODS:
        # A bucket per token and address: one team behind a shared address (a NAT, a
        # proxy) cannot spend another's writes.
        client = request.remote or "unknown"
        wait = context(request).limiter.take(f"{grant.name}@{client}")
        if wait > 0:
            limit = context(request).limiter.limit
            response = problem(
                429,
                f"too many writes from {client}: at most "
                f"{limit.per_second:g} per second (bursts of {limit.burst});"
                f" retry after {wait:.2f} s",
            )
            response.headers["Retry-After"] = str(math.ceil(wait))
            return response
    answer = await handler(request)
    if request.method in WRITE_METHODS:
        context(request).audit.wake()  # a change's record is pending: copy it soon
    return answer


@web.middleware
async def known_query(request: web.Request, handler: Any) -> web.StreamResponse:
    """A query parameter the route does not take is refused with 400 naming it: ignored,
    ``GET /runs?schedule=X`` answered every schedule's runs as if filtered."""
    route = request.match_info.route.resource
    known = (
        context(request).query.get((request.method, route.canonical)) if route is not None else None
    )
    if known is not None:
        unknown = sorted(set(request.query) - known)
        if unknown:
            takes = ", ".join(sorted(known)) or "none"
            raise BadRequest(
                400,
                unknown[0],
                f"unknown query parameter {unknown[0]!r}; this route takes: {takes}",
            )
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
        if not fields.NAMESPACE.fullmatch(asked):
            raise BadRequest(
                422, "namespace", "namespace must be a DNS label: lowercase letters, digits or '-'"
            )
        require(request, Action.READ, asked)
        return [asked]
    return None if grant.everywhere else sorted(grant.namespaces)


def actor(request: web.Request) -> Actor:
    """Who is asking, from where, and why (X-Reason), for the audit trail."""
    reason = request.headers.get("X-Reason")
    if reason is not None and (len(reason) > MAX_REASON_CHARS or not reason.strip()):
        raise BadRequest(422, "X-Reason", f"X-Reason is 1 to {MAX_REASON_CHARS} characters")
    # The actor is the token's; X-Change-Origin is only the client's word about itself,
    # kept (if it is one the trail knows) as the record's detail.via.
    origin = request.headers.get("X-Change-Origin")
    return Actor(
        grant_of(request).name,
        request.remote,
        reason,
        origin if origin == history.APPLY_ORIGIN else None,
    )


def change_by(request: web.Request, namespace: str, given: Actor | None = None) -> Actor:
    """``actor``, refused (422 naming X-Reason) where the namespace requires a reason."""
    who = given or actor(request)
    if who.reason is None and context(request).access.current.rules_of(namespace).require_reason:
        raise BadRequest(
            422,
            "X-Reason",
            f"namespace {namespace!r} requires a reason for "
            "every change: send it in the X-Reason header",
        )
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
            context(request).metrics.http.labels(name, request.method, str(status)).inc()
            if span is not None:
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(tracing.Status(tracing.StatusCode.ERROR))


@contextlib.contextmanager
def _server_span(request: web.Request, route: str) -> Iterator[tracing.Span | None]:
    if not tracing.enabled():
        yield None
        return
    parent = tracing.context_of(
        request.headers.get("traceparent"), request.headers.get("tracestate")
    )
    with tracing.tracer().start_as_current_span(
        f"{request.method} {route}",
        context=parent,
        kind=tracing.SpanKind.SERVER,
        attributes={
            "http.request.method": request.method,
            "http.route": route,
            "url.path": request.path,
        },
    ) as span:
        yield span


def runs_record(
    request: web.Request,
    action: str,
    who: Actor,
    namespace: str,
    schedule_id: str,
    detail: dict[str, Any],
    incarnation: dt.datetime | None = None,
) -> dict[str, Any]:
    """The audit record of a change to a schedule's runs (the schedule stays as it is) of
    the schedule created at ``incarnation``."""
    made = history.record(action, who, now_of(request), namespace, schedule_id, None, detail=detail)
    return history.of_incarnation(made, incarnation)
