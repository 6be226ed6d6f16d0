"""Every error the API can answer, mapped to its status in one place.

Client mistakes get a 4xx whose body names the field; only a bug gives a 500.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web
from pydantic import ValidationError
from pymongo.errors import PyMongoError

from hascheduler.core.errors import (
    BrokerRefused,
    RevisionConflict,
    RunConflict,
    RunNotFound,
    ScheduleExists,
    ScheduleNotFound,
)

log = structlog.get_logger("hascheduler.api")


class BadRequest(Exception):
    """A request the API refuses; ``status`` and the named ``field`` go to the client."""

    def __init__(self, status: int, field: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.field = field
        self.message = message


class Forbidden(Exception):
    """The caller's grant does not reach this action in this namespace (403)."""

    def __init__(self, title: str, action: str, namespace: str | None) -> None:
        super().__init__(title)
        self.title = title
        self.action = action
        self.namespace = namespace


def problem(
    status: int, title: str, errors: list[dict[str, str]] | None = None, **extra: Any
) -> web.Response:
    body: dict[str, Any] = {"status": status, "title": title, **extra}
    if errors is not None:
        body["errors"] = errors
    return web.json_response(body, status=status)


_TYPE_NAMES = {"str", "float", "int", "bool", "datetime"}


def validation_errors(exc: ValidationError, prefix: tuple[str, ...] = ()) -> list[dict[str, str]]:
    out = []
    for err in exc.errors(include_url=False):
        # Discriminated unions put the variant's tag in the path; users wrote no such key.
        # Members of a plain union are named by type ("float", "list[...]", "function-
        # before[...]"): not fields either.
        loc = [
            str(p)
            for p in (*prefix, *err["loc"])
            if not (isinstance(p, str) and ("[" in p or p in _TYPE_NAMES))
        ]
        path = [
            p for i, p in enumerate(loc) if p not in {"cron", "interval", "at"} or i == len(loc) - 1
        ]
        if err["type"] in {"union_tag_invalid", "union_tag_not_found"}:
            path.append("kind")  # the discriminator the client got wrong
        message = err["msg"].removeprefix("Value error, ")
        out.append({"field": ".".join(path) or "body", "message": message})
    return out


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as exc:
        return problem(exc.status, exc.message, [{"field": exc.field, "message": exc.message}])
    except Forbidden as exc:
        return problem(403, exc.title, action=exc.action, namespace=exc.namespace)
    except ValidationError as exc:
        return problem(422, "the schedule is not valid", validation_errors(exc))
    except (ScheduleNotFound, RunNotFound) as exc:
        return problem(404, str(exc))
    except RunConflict as exc:
        return problem(409, str(exc))
    except BrokerRefused as exc:
        return problem(503, str(exc))
    except ScheduleExists as exc:
        return problem(409, str(exc), [{"field": "id", "message": str(exc)}])
    except RevisionConflict as exc:
        return problem(
            409,
            str(exc),
            [{"field": "If-Match", "message": str(exc)}],
            current_revision=exc.current,
        )
    except web.HTTPRequestEntityTooLarge as exc:
        return problem(
            413, "the body is too large", [{"field": "body", "message": exc.text or "too large"}]
        )
    except web.HTTPException as exc:
        if exc.status >= 400 and exc.content_type != "application/json":
            response = problem(exc.status, exc.reason)
            if "Allow" in exc.headers:  # a 405 says which methods the path has
                response.headers["Allow"] = exc.headers["Allow"]
            return response
        raise
    except PyMongoError as exc:
        log.warning("database_unavailable", error=str(exc), path=request.path)
        return problem(503, "the database is unavailable; retry later")
    except json.JSONDecodeError as exc:
        return problem(
            400, f"the body is not valid JSON: {exc.msg}", [{"field": "body", "message": exc.msg}]
        )
