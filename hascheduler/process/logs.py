"""Structured logging: one event per line, JSON unless a person is watching a terminal.

Every line carries the replica's id and the lease term it last saw (``identify`` and
``set_term``: process-wide, so lines from any task have them, not only from tasks started
after a contextvar was bound), and credentials in URIs are masked wherever they appear.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

from hascheduler.process import tracing

# scheme://user:password@host -> scheme://user:***@host (MongoDB, NATS, AMQP URIs alike).
_CREDENTIALS = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]+):[^@/\s]*@")
_identity: dict[str, Any] = {}


def identify(replica_id: str) -> None:
    _identity["replica_id"] = replica_id


def set_term(term: int | None) -> None:
    _identity["term"] = term


def redact(text: str) -> str:
    return _CREDENTIALS.sub(r"\g<head>:***@", text)


def _add_identity(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key, value in _identity.items():
        event.setdefault(key, value)
    return event


def _redact(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key, value in event.items():
        if isinstance(value, str) and "://" in value:
            event[key] = redact(value)
    return event


class _MalformedRequests(logging.Filter):
    """aiohttp logs a malformed request with the start of its offending line: for an
    over-long Authorization header, a token's secret. Told as one event without it."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        # By name: a command that never serves HTTP does not load aiohttp for this.
        if error is not None and any(c.__name__ == "BadHttpMessage" for c in type(error).__mro__):
            structlog.get_logger("hascheduler.api").info(
                "http_request_malformed",
                status=getattr(error, "code", None),
                kind=type(error).__name__,
            )
            return False
        return True


def configure(level: str = "info", json: bool | None = None) -> None:
    """Send structlog events to stderr (stdout stays free for machine-read output)."""
    server = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _MalformedRequests) for f in server.filters):
        server.addFilter(_MalformedRequests())
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _add_identity,
            tracing.log_fields,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _redact,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
