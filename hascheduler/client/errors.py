"""The API's problem details as exceptions, one class per thing a caller handles apart."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class HaschedulerError(Exception):
    """Any failure of an API call; ``status`` is the HTTP status (0: no answer)."""

    def __init__(
        self, message: str, status: int = 0, body: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body: dict[str, Any] = dict(body or {})

    @property
    def title(self) -> str:
        return str(self.body.get("title", ""))

    @property
    def errors(self) -> list[dict[str, str]]:
        """The fields the API named, as [{"field": ..., "message": ...}]."""
        found = self.body.get("errors")
        return [e for e in found if isinstance(e, dict)] if isinstance(found, list) else []


class Invalid(HaschedulerError):
    """400 or 422: the request named fields the API refused (``errors``)."""


class Unauthorized(HaschedulerError):
    """401 (no or a wrong token) or 403 (the token may not do this)."""


class NotFound(HaschedulerError):
    """404: no such schedule, run, fire or backfill."""


class Conflict(HaschedulerError):
    """409: the id is taken, the revision given is not current (``current_revision``), or
    the run is not in a state that allows it."""

    @property
    def current_revision(self) -> int | None:
        value = self.body.get("current_revision")
        return value if isinstance(value, int) else None


class RateLimited(HaschedulerError):
    """429: too many writes from this client; ``retry_after`` seconds to wait."""

    def __init__(
        self, message: str, status: int, body: Mapping[str, Any] | None, retry_after: float
    ) -> None:
        super().__init__(message, status, body)
        self.retry_after = retry_after


class Unavailable(HaschedulerError):
    """The API could not be reached, or answered 5xx (a replica restarting, not ready)."""


_BY_STATUS: dict[int, type[HaschedulerError]] = {
    400: Invalid,
    422: Invalid,
    401: Unauthorized,
    403: Unauthorized,
    404: NotFound,
    409: Conflict,
    412: Conflict,
}


def error_for(
    method: str, path: str, status: int, body: Any, headers: Mapping[str, str]
) -> HaschedulerError:
    """The exception for an answer of ``status`` (400 or more)."""
    problem = body if isinstance(body, dict) else {}
    title = str(problem.get("title") or f"HTTP {status}")
    named = (
        "; ".join(
            f"{e.get('field')}: {e.get('message')}"
            for e in problem.get("errors", [])
            if isinstance(e, dict)
        )
        if isinstance(problem.get("errors"), list)
        else ""
    )
    message = f"{method} {path}: HTTP {status}: {title}" + (f" ({named})" if named else "")
    if status == 429:
        try:
            wait = max(0.0, float(headers.get("Retry-After", "1")))
        except ValueError:
            wait = 1.0
        return RateLimited(message, status, problem, wait)
    if status >= 500:
        return Unavailable(message, status, problem)
    return _BY_STATUS.get(status, HaschedulerError)(message, status, problem)
