"""The audit trail's records (pure): who changed a schedule, when, from where, what and why.

A record is written in the same single-document write as the change it describes (an
outbox on the changed document, storage/audit_log.py), so a change never goes unrecorded
and no record exists for a change that did not happen. ``before`` and ``after`` are the
schedule as a client sees it (its fields, whether and why it is paused), so any revision
can be restored from the record that produced it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import Any

from hascheduler.core.instants import as_utc

# Every kind of change a record can describe.
CREATE, UPDATE, DELETE, RESTORE, APPLY = "create", "update", "delete", "restore", "apply"
PAUSE, RESUME, COMPLETE = "pause", "resume", "complete"
TRIGGER, BACKFILL, CANCEL, RETRY = "trigger", "backfill", "cancel", "retry"
# Changes that are not a schedule's: a webhook's, and the access file's tokens and rules.
WEBHOOK_CREATE, WEBHOOK_DELETE = "webhook.create", "webhook.delete"
TOKEN_ADD, TOKEN_REVOKE, NAMESPACE_RULES = "token.add", "token.revoke", "namespace.rules"
ACTIONS = (
    CREATE,
    UPDATE,
    DELETE,
    RESTORE,
    APPLY,
    PAUSE,
    RESUME,
    COMPLETE,
    TRIGGER,
    BACKFILL,
    CANCEL,
    RETRY,
    WEBHOOK_CREATE,
    WEBHOOK_DELETE,
    TOKEN_ADD,
    TOKEN_REVOKE,
    NAMESPACE_RULES,
)
MAX_REASON_CHARS = 500
# What `hascheduler apply` sends as X-Change-Origin. A client says it: the record keeps the
# change as what it was, naming the client's word as ``detail.via`` (APPLY is the action
# of records written before).
APPLY_ORIGIN = "apply"


@dataclass(frozen=True)
class Actor:
    """Who asked for a change: a token's name (or a JWT's subject), the client's address,
    and the reason given, if any. The cluster's own changes (a pause after failures, a
    pause ending, max_fires reached) name the process that made them."""

    name: str
    address: str | None = None
    reason: str | None = None
    origin: str | None = None  # APPLY_ORIGIN for `hascheduler apply`'s writes


def redacted(view: dict[str, Any] | None) -> dict[str, Any] | None:
    """``view`` with each payload value replaced by a digest: equal values stay equal,
    so a record still shows that (and which key of) the payload changed."""
    if view is None or not isinstance(view.get("payload"), dict):
        return view
    return {
        **view,
        "payload": {
            key: "redacted:"
            + hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[
                :16
            ]
            for key, value in view["payload"].items()
        },
    }


def changed_fields(before: dict[str, Any] | None, after: dict[str, Any] | None) -> list[str]:
    before, after = before or {}, after or {}
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def record(
    action: str,
    actor: Actor,
    at: dt.datetime,
    namespace: str,
    schedule_id: str,
    revision: int | None,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    detail: dict[str, Any] | None = None,
    redact: bool = False,
) -> dict[str, Any]:
    """One audit record. ``revision``: the schedule's revision after the change (None for
    a change to its runs, which leaves the schedule as it was)."""
    if actor.origin is not None:
        detail = {**(detail or {}), "via": actor.origin}
    return {
        "_id": uuid.uuid4().hex,
        "at": at,
        "actor": actor.name,
        "from": actor.address,
        "action": action,
        "namespace": namespace,
        "schedule_id": schedule_id,
        "revision": revision,
        "changed": changed_fields(before, after),
        "before": redacted(before) if redact else before,
        "after": redacted(after) if redact else after,
        "reason": actor.reason,
        "detail": detail or {},
    }


def public(doc: dict[str, Any]) -> dict[str, Any]:
    """A stored record as the API shows it."""
    at = as_utc(doc.get("at"))
    return {
        "id": doc["_id"],
        "at": at.isoformat() if isinstance(at, dt.datetime) else at,
        **{
            k: doc.get(k)
            for k in (
                "actor",
                "from",
                "action",
                "namespace",
                "schedule_id",
                "revision",
                "changed",
                "before",
                "after",
                "reason",
                "detail",
            )
        },
    }


def of_incarnation(made: dict[str, Any], incarnation: dt.datetime | None) -> dict[str, Any]:
    """``made`` (a record) naming the incarnation of its schedule: when it was created, so
    that an id reused after a delete starts another history."""
    return made if incarnation is None else {**made, "incarnation": incarnation}
