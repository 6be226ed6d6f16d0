"""Webhooks: created, listed, read, deleted, and their deliveries."""

from __future__ import annotations

import datetime as dt
import secrets
import uuid
from typing import Any

import structlog
from aiohttp import web

from hascheduler.api.access import Action
from hascheduler.api.context import context, webhooks_of
from hascheduler.api.errors import BadRequest
from hascheduler.api.guards import (
    BODY,
    LISTING,
    WEBHOOK,
    Guard,
)
from hascheduler.api.middleware import change_by, grant_of, readable_namespaces, require
from hascheduler.api.openapi import (
    NAMESPACE_PARAM,
    WRITE,
    json_body,
    responses,
)
from hascheduler.api.params import as_json, int_param, now_of, read_json
from hascheduler.api.route import Route
from hascheduler.api.views import (
    shown_time,
)
from hascheduler.core import history, models
from hascheduler.core.constants import (
    DEFAULT_PAGE,
    MAX_PAGE,
)
from hascheduler.core.egress import shown_url
from hascheduler.core.instants import as_utc
from hascheduler.storage.webhooks import WebhookExists

log = structlog.get_logger("hascheduler.api")


# Every event of a namespace is one delivery per webhook: the number is bounded.
MAX_WEBHOOKS_PER_NAMESPACE = 50


def _webhook_view(doc: dict[str, Any], secret: str | None = None) -> models.Webhook:
    return models.Webhook(
        id=doc["_id"],
        url=shown_url(doc["url"]),  # a password in it is never shown back
        events=doc["events"],
        namespace=doc["namespace"],
        schedule_id=doc.get("schedule_id"),
        created_at=as_utc(doc["created_at"]),
        secret=secret,
    )


async def create_webhook(request: web.Request) -> web.Response:
    """A webhook in a namespace (admin there): its secret is in this answer, never again."""
    store, _ = webhooks_of(request)
    wanted = models.WebhookIn.model_validate(await read_json(request))
    require(request, Action.ADMIN, wanted.namespace)
    refusal = context(request).egress.url_refusal(wanted.url)
    if refusal is not None:
        raise BadRequest(422, "url", f"url: {refusal}")
    if wanted.schedule_id is not None:
        namespace = await context(request).store.namespace_of(wanted.schedule_id)
        if namespace != wanted.namespace:
            raise BadRequest(
                422,
                "schedule_id",
                f"no schedule {wanted.schedule_id!r} in namespace {wanted.namespace!r}",
            )
    if len(await store.in_namespaces([wanted.namespace])) >= MAX_WEBHOOKS_PER_NAMESPACE:
        raise BadRequest(
            409,
            "namespace",
            f"namespace {wanted.namespace!r} has "
            f"{MAX_WEBHOOKS_PER_NAMESPACE} webhooks already, the most it may: "
            "each event is delivered to each of them",
        )
    secret = wanted.secret or secrets.token_urlsafe(32)
    doc = {
        "_id": wanted.id or uuid.uuid4().hex,
        "url": wanted.url,
        "events": wanted.events,
        "namespace": wanted.namespace,
        "schedule_id": wanted.schedule_id,
        "secret": secret,
        "created_at": now_of(request),
        "created_by": grant_of(request).name,
    }
    try:
        await store.create(doc, _record(request, history.WEBHOOK_CREATE, doc))
    except WebhookExists:
        raise BadRequest(409, "id", f"a webhook {doc['_id']!r} exists") from None
    log.info(
        "webhook_created",
        webhook=doc["_id"],
        namespace=wanted.namespace,
        events=wanted.events,
        by=doc["created_by"],
    )
    return as_json(_webhook_view(doc, secret), 201)


def _record(request: web.Request, action: str, doc: dict[str, Any]) -> dict[str, Any]:
    """The audit record of a webhook made or deleted: what it was, never its secret."""
    detail = {
        "webhook_id": doc["_id"],
        "url": shown_url(doc["url"]),
        "events": doc["events"],
        "schedule_id": doc.get("schedule_id"),
    }
    return history.record(
        action,
        change_by(request, doc["namespace"]),
        now_of(request),
        doc["namespace"],
        doc.get("schedule_id") or "",
        None,
        detail=detail,
    )


async def list_webhooks(request: web.Request) -> web.Response:
    store, _ = webhooks_of(request)
    docs = await store.in_namespaces(readable_namespaces(request))
    return as_json(models.WebhookList(items=[_webhook_view(d) for d in docs]))


async def _webhook(request: web.Request) -> dict[str, Any]:
    doc = await webhooks_of(request)[0].get(request.match_info["id"])
    if doc is None:
        raise web.HTTPNotFound(reason=f"no webhook {request.match_info['id']!r}")
    return doc


async def get_webhook(request: web.Request) -> web.Response:
    return as_json(_webhook_view(await _webhook(request)))


async def delete_webhook(request: web.Request) -> web.Response:
    store, deliveries = webhooks_of(request)
    doc = await _webhook(request)
    await store.delete(doc["_id"], _record(request, history.WEBHOOK_DELETE, doc))
    await deliveries.forget(doc["_id"])
    log.info("webhook_deleted", webhook=doc["_id"], by=grant_of(request).name)
    return web.Response(status=204)


async def webhook_deliveries(request: web.Request) -> web.Response:
    """A webhook's deliveries, newest first, each with its attempts."""
    doc = await _webhook(request)
    limit = int_param(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
    items = [_delivery_view(d) for d in await webhooks_of(request)[1].of(doc["_id"], limit)]
    return web.json_response({"items": items})


def _delivery_view(doc: dict[str, Any]) -> dict[str, Any]:
    def shown(value: Any) -> Any:
        return shown_time(as_utc(value)) if isinstance(value, dt.datetime) else value

    return {
        "id": doc["_id"],
        "event_id": doc["event_id"],
        "type": doc["type"],
        "schedule_id": doc.get("schedule_id"),
        "state": doc["state"],
        "attempts": doc["attempts"],
        "created_at": shown(doc["created_at"]),
        "next_at": shown(doc.get("next_at")) if doc["state"] == "pending" else None,
        "last_at": shown(doc.get("last_at")),
        "last_status": doc.get("last_status"),
        "last_error": doc.get("last_error"),
        "history": [{k: shown(v) for k, v in a.items()} for a in doc.get("history", [])],
    }


ROUTES: list[Route] = [
    Route(
        "POST",
        "/webhooks",
        create_webhook,
        Guard(Action.ADMIN, BODY),
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
        list_webhooks,
        Guard(Action.READ, LISTING),
        {
            "summary": "the webhooks of the namespaces the caller may read",
            "parameters": [NAMESPACE_PARAM],
            "responses": responses(200, "WebhookList", 403, 422),
        },
    ),
    Route(
        "GET",
        "/webhooks/{id}",
        get_webhook,
        Guard(Action.READ, WEBHOOK),
        {
            "summary": "one webhook (never its secret)",
            "responses": responses(200, "Webhook", 403, 404),
        },
    ),
    Route(
        "DELETE",
        "/webhooks/{id}",
        delete_webhook,
        Guard(Action.ADMIN, WEBHOOK),
        {
            "summary": "delete a webhook and its deliveries",
            "responses": responses(204, None, 403, 404),
        },
    ),
    Route(
        "GET",
        "/webhooks/{id}/deliveries",
        webhook_deliveries,
        Guard(Action.READ, WEBHOOK),
        {
            "summary": "a webhook's deliveries, newest first: state (pending, delivered, "
            "failed), attempts with their status, error and duration",
            "parameters": [
                {
                    "name": "limit",
                    "in": "query",
                    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE},
                }
            ],
            "responses": responses(200, None, 403, 404, 422),
        },
    ),
]
