"""The audit trail, read."""

from __future__ import annotations

from aiohttp import web

from hascheduler.api.context import context
from hascheduler.api.errors import problem
from hascheduler.api.middleware import readable_namespaces
from hascheduler.api.params import int_param, now_of, time_param
from hascheduler.core import history
from hascheduler.core.constants import (
    DEFAULT_PAGE,
    MAX_PAGE,
)


async def audit_log(request: web.Request) -> web.Response:
    """The audit trail, newest first: ?namespace=&schedule=&actor=&since=&before=&limit=."""
    since = request.query.get("since")
    try:
        docs = await context(request).audit.query(
            namespaces=readable_namespaces(request), schedule_id=request.query.get("schedule"),
            actor=request.query.get("actor"),
            since=None if since is None else time_param(request, "since", now_of(request)),
            before=request.query.get("before"),
            limit=int_param(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE))
    except LookupError:
        return problem(404, "before names no record (it may have expired): list from the "
                            "start")
    items = [history.public(d) for d in docs]
    return web.json_response({"items": items, "next": items[-1]["id"] if len(items) ==
                              int_param(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
                              else None})
