"""The cluster's own state: liveness and readiness, the leader, the members, a mirror's
entry, metrics, and who a token is."""

from __future__ import annotations

import datetime as dt
from typing import Any

from aiohttp import web

from hascheduler.api.access import Action, Denied, authenticate, refusal
from hascheduler.api.context import Cluster, cluster_of, context
from hascheduler.api.errors import Forbidden, problem
from hascheduler.api.guards import (
    CLUSTER_WIDE,
    SCHEDULE,
    Guard,
)
from hascheduler.api.middleware import denied_response, grant_of
from hascheduler.api.openapi import (
    ref,
    responses,
)
from hascheduler.api.params import now_of
from hascheduler.api.route import OPEN, Route
from hascheduler.api.views import (
    shown_time,
)
from hascheduler.core.constants import (
    HEARTBEAT_INTERVAL_S,
    LEASE_NAME,
)
from hascheduler.core.triggers import fire_times
from hascheduler.process.metrics import CONTENT_TYPE
from hascheduler.storage.lease import read_lease


async def metrics(request: web.Request) -> web.Response:
    """The metrics; with ``serve --metrics-need-token``, to a token that may read."""
    if context(request).metrics_need_token:
        grant = authenticate(context(request).access.current, request.headers.get("Authorization"))
        if isinstance(grant, Denied):
            return denied_response(grant)
        if not grant.can(Action.READ):
            raise Forbidden(refusal(grant, Action.READ, None).title, Action.READ, None)
    body = context(request).metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def mirror_entry(request: web.Request) -> web.Response:
    """What this replica's mirror holds for one schedule (for comparing replicas)."""
    schedule_id = request.match_info["id"]
    mirror = context(request).mirror
    entry = mirror.entries.get(schedule_id)
    if entry is None:
        await context(request).store.get(schedule_id)  # 404 for a schedule nobody made
        return problem(
            404,
            f"schedule {schedule_id!r} is not in this replica's mirror",
            replica_id=context(request).replica_id,
        )
    nominal = next(fire_times(entry.trigger, now_of(request), limit=1), None)
    return web.json_response(
        {
            "id": schedule_id,
            "revision": entry.revision,
            "paused": entry.paused,
            "next_nominal": nominal.isoformat() if nominal else None,
            "applied_at": mirror.recently_applied.get(schedule_id),
            "replica_id": context(request).replica_id,
        }
    )


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive", "replica_id": context(request).replica_id})


async def readyz(request: web.Request) -> web.Response:
    status = context(request).mirror.status()
    status["replica_id"] = context(request).replica_id
    sources = context(request).sources
    if sources is not None:  # the fan-out sources' mirrors: equal digests, equal copies
        status["sources"] = sources.summary()
        status["sources_ready"] = sources.ready
    server_clock = context(request).server_clock
    if server_clock is not None:  # a replica that may not lead says why (invariant 12)
        status["clock"] = server_clock.status()
    cluster = context(request).cluster
    if cluster is not None:
        status["unfit_to_lead"] = cluster.elector.unfit_reason
    return web.json_response(status, status=200 if status["ready"] else 503)


async def leader_view(request: web.Request, cluster: Cluster) -> dict[str, Any]:
    view = await read_lease(cluster.leases, LEASE_NAME)
    held = view is not None and view.held_at(now_of(request))
    return {
        "holder": view.holder if held and view else None,
        "last_holder": view.holder if view else None,
        "term": view.term if view else 0,
        "expires_at": shown_time(view.expires_at) if view else None,
        "fired_through": shown_time(view.fired_through) if view else None,
        "answered_by": context(request).replica_id,
        "answered_by_leader": bool(cluster.elector.is_leader),
    }


async def leader(request: web.Request) -> web.Response:
    """The lease as the database holds it, and which replica answered."""
    return web.json_response(await leader_view(request, cluster_of(request)))


async def members_view(request: web.Request, cluster: Cluster) -> list[dict[str, Any]]:
    now = now_of(request)
    fresh = now - dt.timedelta(seconds=3 * HEARTBEAT_INTERVAL_S)
    # The leader is the live lease's holder: a heartbeat only says what its replica
    # believed when it was sent, and a departed leader's last one said so.
    view = await read_lease(cluster.leases, LEASE_NAME)
    holder = view.holder if view is not None and view.held_at(now) else None
    out = []
    for doc in await cluster.members.seen_since(fresh):
        out.append(
            {
                "replica_id": doc["_id"],
                "url": doc.get("url"),
                "ready": doc.get("ready"),
                "size": doc.get("size"),
                "digest": doc.get("digest"),
                "leader": doc["_id"] == holder,
                "term": doc.get("term"),
                "seen_at": shown_time(doc.get("seen_at")),
            }
        )
    return out


async def members(request: web.Request) -> web.Response:
    return web.json_response(
        {
            "members": await members_view(request, cluster_of(request)),
            "answered_by": context(request).replica_id,
        }
    )


async def whoami(request: web.Request) -> web.Response:
    grant = grant_of(request)
    return web.json_response(
        {
            "name": grant.name,
            "actions": sorted(a.value for a in grant.actions),
            "namespaces": sorted(grant.namespaces),
        }
    )


ROUTES: list[Route] = [
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
            "summary": "Prometheus metrics (no token needed, unless serve --metrics-need-token)",
            "security": [],
            "responses": {"200": {"description": "text exposition format"}},
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
]
