"""Every API call as a value: what to send and how to read the answer (pure). The sync and
async clients only carry these over HTTP, so each route is described once."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote

from pydantic import BaseModel

from hascheduler.core import models
from hascheduler.core.health import ScheduleHealth

T = TypeVar("T")
Document = dict[str, Any]

# The fields of a stored schedule the server sets; a replacement (PUT) leaves them out.
SERVER_FIELDS = frozenset(
    {"id", "pause", "completed", "fires_remaining", "created_at", "updated_at", "revision"}
)


@dataclass(frozen=True)
class Call(Generic[T]):
    method: str
    path: str
    read: Callable[[bytes], T]  # the answer's body to its value
    params: tuple[tuple[str, str], ...] = ()
    json: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    # Safe to send again when no answer came: reads, PUT, DELETE, and a POST carrying an
    # Idempotency-Key.
    idempotent: bool = False


def _segment(value: str) -> str:
    return quote(value, safe="@:")


def _body(value: BaseModel | Mapping[str, Any]) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_none=True)
    return dict(value)


def _if_match(revision: int | None) -> dict[str, str]:
    return {"If-Match": f'"{revision}"'} if revision is not None else {}


def _instant(value: dt.datetime | str) -> str:
    return value.isoformat() if isinstance(value, dt.datetime) else value


# Readers: the answer's raw JSON to its value. Models read it in JSON mode, where an
# instant is the text the API wrote.
def _schedule(raw: bytes) -> models.Schedule:
    return models.Schedule.model_validate_json(raw, context={"stored": True})


def _page(raw: bytes) -> tuple[list[models.Schedule], str | None]:
    page = models.ScheduleList.model_validate_json(raw, context={"stored": True})
    return page.items, page.next


def _documents(raw: bytes) -> tuple[list[Document], str | None]:
    body = json.loads(raw)
    return list(body["items"]), body.get("next")


def _document(raw: bytes) -> Document:
    return dict(json.loads(raw))


def _nothing(raw: bytes) -> None:
    return None


def _batch(raw: bytes) -> models.BatchCreated:
    return models.BatchCreated.model_validate_json(raw)


def _triggered(raw: bytes) -> models.Triggered:
    return models.Triggered.model_validate_json(raw)


def _preview(raw: bytes) -> models.Preview:
    return models.Preview.model_validate_json(raw)


def create_schedule(schedule: models.ScheduleIn | Mapping[str, Any]) -> Call[models.Schedule]:
    return Call("POST", "/schedules", _schedule, json=_body(schedule))


def create_schedules(
    schedules: Sequence[models.ScheduleIn | Mapping[str, Any]],
) -> Call[models.BatchCreated]:
    """Many at once; sending it again creates nothing twice (ids taken come back in
    ``existing``)."""
    return Call(
        "POST",
        "/schedules:batch",
        _batch,
        json={"schedules": [_body(s) for s in schedules]},
        idempotent=True,
    )


def get_schedule(schedule_id: str) -> Call[models.Schedule]:
    return Call("GET", f"/schedules/{_segment(schedule_id)}", _schedule, idempotent=True)


def schedules_page(
    labels: Mapping[str, str] | None,
    paused: bool | None,
    after: str | None,
    limit: int,
    namespace: str | None = None,
) -> Call[tuple[list[models.Schedule], str | None]]:
    params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
    if namespace is not None:
        params.append(("namespace", namespace))
    if paused is not None:
        params.append(("paused", "true" if paused else "false"))
    if after is not None:
        params.append(("after", after))
    params.append(("limit", str(limit)))
    return Call("GET", "/schedules", _page, params=tuple(params), idempotent=True)


def schedules_health_page(
    labels: Mapping[str, str] | None,
    paused: bool | None,
    after: str | None,
    limit: int,
    namespace: str | None = None,
) -> Call[models.ScheduleList]:
    """A page of schedules with each one's health (the list's health column)."""
    page = schedules_page(labels, paused, after, limit, namespace)
    return Call(
        "GET",
        "/schedules",
        _schedule_list,
        params=(*page.params, ("health", "true")),
        idempotent=True,
    )


def _schedule_list(raw: bytes) -> models.ScheduleList:
    return models.ScheduleList.model_validate_json(raw, context={"stored": True})


def schedule_documents_page(
    labels: Mapping[str, str] | None, after: str | None, limit: int, namespace: str | None = None
) -> Call[tuple[list[Document], str | None]]:
    """A page of schedules as the API's JSON, unvalidated: for comparing many with
    declarations (apply), where reading each into its model would double the cost."""
    page = schedules_page(labels, None, after, limit, namespace)
    return Call(page.method, page.path, _documents, params=page.params, idempotent=True)


def replace_schedule(
    schedule_id: str, fields: models.ScheduleFields | Mapping[str, Any], if_match: int | None = None
) -> Call[models.Schedule]:
    body = {k: v for k, v in _body(fields).items() if k not in SERVER_FIELDS}
    return Call(
        "PUT",
        f"/schedules/{_segment(schedule_id)}",
        _schedule,
        json=body,
        headers=_if_match(if_match),
        idempotent=True,
    )


def update_schedule(schedule: models.Schedule) -> Call[models.Schedule]:
    """A fetched schedule, changed, written back only if nobody changed it meanwhile."""
    return replace_schedule(schedule.id, schedule, if_match=schedule.revision)


def patch_schedule(
    schedule_id: str, patch: Mapping[str, Any], if_match: int | None = None
) -> Call[models.Schedule]:
    return Call(
        "PATCH",
        f"/schedules/{_segment(schedule_id)}",
        _schedule,
        json=dict(patch),
        headers=_if_match(if_match),
    )


def delete_schedule(schedule_id: str, if_match: int | None = None) -> Call[None]:
    return Call(
        "DELETE",
        f"/schedules/{_segment(schedule_id)}",
        _nothing,
        headers=_if_match(if_match),
        idempotent=True,
    )


def pause(
    schedule_id: str,
    note: str | None = None,
    until: dt.datetime | str | None = None,
    if_match: int | None = None,
) -> Call[models.Schedule]:
    why: Document = {}
    if note is not None:
        why["note"] = note
    if until is not None:
        why["until"] = _instant(until)
    return Call(
        "POST",
        f"/schedules/{_segment(schedule_id)}/pause",
        _schedule,
        json=why or None,
        headers=_if_match(if_match),
        idempotent=True,
    )


def resume(schedule_id: str, if_match: int | None = None) -> Call[models.Schedule]:
    return Call(
        "POST",
        f"/schedules/{_segment(schedule_id)}/resume",
        _schedule,
        headers=_if_match(if_match),
        idempotent=True,
    )


def trigger(
    schedule_id: str,
    payload: Mapping[str, Any] | None = None,
    overlap: str | None = None,
    force: bool = False,
    idempotency_key: str | None = None,
    priority: int | None = None,
) -> Call[models.Triggered]:
    body: Document = {"force": True} if force else {}
    if priority is not None:
        body["priority"] = priority
    if payload is not None:
        body["payload"] = dict(payload)
    if overlap is not None:
        body["overlap"] = overlap
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    return Call(
        "POST",
        f"/schedules/{_segment(schedule_id)}/trigger",
        _triggered,
        json=body,
        headers=headers,
        idempotent=idempotency_key is not None,
    )


def backfill(
    schedule_id: str, start: dt.datetime | str, end: dt.datetime | str, overlap: str | None = None
) -> Call[Document]:
    body: Document = {"start": _instant(start), "end": _instant(end)}
    if overlap is not None:
        body["overlap"] = overlap
    return Call("POST", f"/schedules/{_segment(schedule_id)}/backfill", _document, json=body)


def get_backfill(backfill_id: str) -> Call[Document]:
    return Call("GET", f"/backfills/{_segment(backfill_id)}", _document, idempotent=True)


def cancel_backfill(backfill_id: str) -> Call[Document]:
    return Call("DELETE", f"/backfills/{_segment(backfill_id)}", _document, idempotent=True)


def next_fires(
    schedule_id: str, count: int = 5, after: dt.datetime | str | None = None
) -> Call[models.Preview]:
    params = [("count", str(count))]
    if after is not None:
        params.append(("after", _instant(after)))
    return Call(
        "GET",
        f"/schedules/{_segment(schedule_id)}/next",
        _preview,
        params=tuple(params),
        idempotent=True,
    )


def _health(raw: bytes) -> ScheduleHealth:
    return ScheduleHealth.model_validate_json(raw)


def health(schedule_id: str) -> Call[ScheduleHealth]:
    return Call("GET", f"/schedules/{_segment(schedule_id)}/health", _health, idempotent=True)


def create_webhook(webhook: models.WebhookIn | Mapping[str, Any]) -> Call[models.Webhook]:
    return Call("POST", "/webhooks", models.Webhook.model_validate_json, json=_body(webhook))


def webhooks(namespace: str | None = None) -> Call[models.WebhookList]:
    params = (("namespace", namespace),) if namespace is not None else ()
    return Call(
        "GET", "/webhooks", models.WebhookList.model_validate_json, params=params, idempotent=True
    )


def get_webhook(webhook_id: str) -> Call[models.Webhook]:
    return Call(
        "GET",
        f"/webhooks/{_segment(webhook_id)}",
        models.Webhook.model_validate_json,
        idempotent=True,
    )


def delete_webhook(webhook_id: str) -> Call[None]:
    return Call("DELETE", f"/webhooks/{_segment(webhook_id)}", _nothing, idempotent=True)


def webhook_deliveries(webhook_id: str, limit: int = 100) -> Call[Document]:
    return Call(
        "GET",
        f"/webhooks/{_segment(webhook_id)}/deliveries",
        _document,
        params=(("limit", str(limit)),),
        idempotent=True,
    )


def schedule_fires(schedule_id: str, limit: int = 50) -> Call[Document]:
    return Call(
        "GET",
        f"/schedules/{_segment(schedule_id)}/fires",
        _document,
        params=(("limit", str(limit)),),
        idempotent=True,
    )


def schedule_runs(schedule_id: str, limit: int = 50) -> Call[Document]:
    return Call(
        "GET",
        f"/schedules/{_segment(schedule_id)}/runs",
        _document,
        params=(("limit", str(limit)),),
        idempotent=True,
    )


def runs_page(
    state: str | None, after: str | None, limit: int, namespace: str | None = None
) -> Call[tuple[list[Document], str | None]]:
    params = [("limit", str(limit))]
    if namespace is not None:
        params.append(("namespace", namespace))
    if state is not None:
        params.append(("state", state))
    if after is not None:
        params.append(("after", after))
    return Call("GET", "/runs", _documents, params=tuple(params), idempotent=True)


def get_run(fire_id: str) -> Call[Document]:
    return Call("GET", f"/runs/{_segment(fire_id)}", _document, idempotent=True)


def retry_run(fire_id: str) -> Call[Document]:
    return Call("POST", f"/runs/{_segment(fire_id)}/retry", _document)


def cancel_run(fire_id: str) -> Call[Document]:
    return Call("POST", f"/runs/{_segment(fire_id)}/cancel", _document, idempotent=True)


def get_fire(fire_id: str) -> Call[Document]:
    return Call("GET", f"/fires/{_segment(fire_id)}", _document, idempotent=True)


def leader() -> Call[Document]:
    return Call("GET", "/leader", _document, idempotent=True)


def cluster() -> Call[Document]:
    return Call("GET", "/cluster", _document, idempotent=True)


def readiness() -> Call[Document]:
    return Call("GET", "/readyz", _document, idempotent=True)


def history_page(
    schedule_id: str, before: str | None, limit: int
) -> Call[tuple[list[Document], str | None]]:
    params = [("limit", str(limit))] + ([("before", before)] if before else [])
    return Call(
        "GET",
        f"/schedules/{_segment(schedule_id)}/history",
        _documents,
        params=tuple(params),
        idempotent=True,
    )


def audit_page(
    namespace: str | None,
    schedule_id: str | None,
    actor: str | None,
    since: dt.datetime | str | None,
    before: str | None,
    limit: int,
) -> Call[tuple[list[Document], str | None]]:
    params = [("limit", str(limit))]
    for name, value in (
        ("namespace", namespace),
        ("schedule", schedule_id),
        ("actor", actor),
        ("before", before),
    ):
        if value is not None:
            params.append((name, value))
    if since is not None:
        params.append(("since", _instant(since)))
    return Call("GET", "/audit", _documents, params=tuple(params), idempotent=True)


def restore(schedule_id: str, revision: int, if_match: int | None = None) -> Call[models.Schedule]:
    return Call(
        "POST",
        f"/schedules/{_segment(schedule_id)}/restore",
        _schedule,
        json={"revision": revision},
        headers=_if_match(if_match),
    )
