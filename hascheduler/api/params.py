"""Reading a request: its JSON body, its query parameters and headers, each refused with a
4xx naming the field; and answering with a model as JSON."""

from __future__ import annotations

import datetime as dt
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from hascheduler.api.context import context
from hascheduler.api.errors import BadRequest
from hascheduler.api.openapi import IF_MATCH
from hascheduler.core import fields
from hascheduler.core.clock import Clock

_JSON_TYPES = {"application/json", "application/merge-patch+json"}


def as_json(model: BaseModel, status: int = 200, **headers: str) -> web.Response:
    return web.Response(
        text=model.model_dump_json(),
        status=status,
        content_type="application/json",
        headers=headers,
    )


async def read_json(request: web.Request) -> dict[str, Any]:
    if request.content_type not in _JSON_TYPES:
        raise BadRequest(415, "Content-Type", "send the body as application/json")
    raw = await request.read()
    try:
        body = fields.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(400, "body", f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(422, "body", "the body must be a JSON object")
    return body


async def read_optional_json(request: web.Request) -> dict[str, Any]:
    """``read_json``, or {} for a request sent without one."""
    return await read_json(request) if (await request.read()).strip() else {}


def expected_revision(request: web.Request) -> int | None:
    header = request.headers.get("If-Match")
    if header is None:
        return None
    match = IF_MATCH.fullmatch(header)
    if match is None:
        raise BadRequest(
            400,
            "If-Match",
            "If-Match must be a schedule revision, as the "
            'ETag header gives it (for example "3"), or *',
        )
    return int(match[1]) if match[1] else None


def int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    if not text.lstrip("-").isdigit() or not low <= int(text) <= high:
        raise BadRequest(422, name, f"{name} must be a whole number from {low} to {high}")
    return int(text)


def bool_param(request: web.Request, name: str) -> bool | None:
    text = request.query.get(name)
    if text is None:
        return None
    if text.lower() not in {"true", "false"}:
        raise BadRequest(422, name, f"{name} must be true or false")
    return text.lower() == "true"


def time_param(request: web.Request, name: str, default: dt.datetime) -> dt.datetime:
    text = request.query.get(name)
    if text is None:
        return default
    try:
        return fields.parse_instant(text)
    except ValueError as exc:
        raise BadRequest(422, name, f"{name} {exc}") from None


def now_of(request: web.Request) -> dt.datetime:
    clock: Clock = context(request).clock
    return clock()


def validate(
    request: web.Request,
    model: type[BaseModel],
    data: dict[str, Any],
    now: dt.datetime,
    stored_trigger: bool = False,
) -> Any:
    return model.model_validate(
        data,
        context={
            "now": now,
            "stored": stored_trigger,
            "min_fire_interval_s": context(request).min_fire_interval_s,
        },
    )
