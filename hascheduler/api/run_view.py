"""A run as the API shows it (GET /runs, /runs/{id}, the dashboard): the model the OpenAPI
document names and the view read from a runs ledger document."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, Field

from hascheduler.core.instants import as_utc


class Run(BaseModel):
    """One fire's run as the API shows it (instants in RFC 3339): never the stored event
    (it is the payload again). Declared once: ``public_view`` and the OpenAPI document
    both read it."""

    id: str = Field(description="the fire id: every handler's idempotency key")
    schedule_id: str
    fire: str | None = Field(None, description="a fan-out run's fire: its id without the tenant")
    tenant: str | None = None
    target: str
    nominal_at: str | None = None
    state: str = Field(
        description="pending, running, succeeded, retrying, dead, "
        "cancelled or waiting (over a concurrency limit)"
    )
    attempts: int
    worker_id: str | None = None
    started_at: str | None = None
    first_started_at: str | None = None
    heartbeat_at: str | None = None
    lease_until: str | None = None
    finished_at: str | None = None
    duration_s: float | None = None
    last_error: str | None = None
    next_attempt_at: str | None = None
    replays: int = 0
    cancel_requested: bool | None = Field(
        None, description="a cancel was asked for while the run was running"
    )
    cancelled_by: str | None = None
    recorded_at: str | None = None
    trace_id: str | None = Field(None, description="the fire's trace, when traced")
    waiting_on: dict[str, str] | None = Field(
        None,
        description='why a waiting run waits: {"concurrency": <its key>} or {"rate": <its key>}',
    )
    waiting_since: str | None = None
    woken_at: str | None = Field(
        None, description="when a parked run's waker took the slot or the start it waited for"
    )
    priority: int | None = None
    attempt_history: list[dict[str, Any]] | None = Field(
        None,
        description="each attempt as it ended (the latest 20): attempt, worker_id, "
        "started_at, finished_at, duration_s, state, error",
    )


class RunList(BaseModel):
    items: list[Run]
    next: str | None = Field(
        default=None,
        description="the after= of the next page (the fire id of this page's last run)",
    )


_PUBLIC_FIELDS = tuple(name for name in Run.model_fields if name != "id")


def _shown(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return as_utc(value).isoformat()
    if isinstance(value, list):
        return [
            {k: _shown(v) for k, v in item.items()} if isinstance(item, dict) else item
            for item in value
        ]
    return value


def public_view(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A run as the API shows it: instants in RFC 3339, the stored event left out."""
    view: dict[str, Any] = {"id": doc["_id"]}
    for name in _PUBLIC_FIELDS:
        if name in doc:
            view[name] = _shown(doc[name])
    return view
