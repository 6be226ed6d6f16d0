"""Webhooks (pure): the events, the CloudEvent each becomes, which webhooks receive it, the
signature on a delivery, and the retry schedule (docs/OPERATIONS.md, "Webhooks").

A delivery is signed as Stripe and GitHub sign theirs: ``Hascheduler-Signature:
t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">`` with the webhook's secret. The
timestamp inside the signed text lets a receiver refuse a replayed delivery (``verify``
with a tolerance); ``Hascheduler-Delivery`` names the delivery, the same on every attempt,
for a receiver to drop duplicates (delivery is at least once).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any

from hascheduler.core.events import EVENT_SOURCE
from hascheduler.core.triggers import iso_utc

RUN_DEAD = "run.dead"
FIRE_SKIPPED = "fire.skipped"
FIRE_FAILED = "fire.failed"
SCHEDULE_PAUSED = "schedule.paused"
SCHEDULE_LATE = "schedule.late"
EVENT_TYPE_PREFIX = "io.hascheduler."

SIGNATURE_HEADER = "Hascheduler-Signature"
DELIVERY_HEADER = "Hascheduler-Delivery"
WEBHOOK_HEADER = "Hascheduler-Webhook"
CONTENT_TYPE = "application/cloudevents+json"

# An attempt's answer is awaited this long; then it counts as failed and is retried.
ATTEMPT_TIMEOUT_S = 5.0
# Retries after 1, 2, 4 ... seconds, at most BACKOFF_CAP_S apart; given up after
# MAX_ATTEMPTS (about 2 h 40 min of an endpoint down), the delivery then ``failed``.
BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 900.0
MAX_ATTEMPTS = 18
# A receiver should refuse a signature older than this (replays); ``verify``'s default.
TOLERANCE_S = 300.0


@dataclass(frozen=True, slots=True)
class Event:
    """Something a webhook may be told: ``id`` is stable (the same event found twice is
    one event, delivered once per webhook, at least once)."""

    id: str
    type: str  # one of core.models.WEBHOOK_EVENTS
    namespace: str
    schedule_id: str
    time: dt.datetime
    data: dict[str, Any]

    def cloudevent(self) -> dict[str, Any]:
        return {
            "specversion": "1.0",
            "id": self.id,
            "source": EVENT_SOURCE,
            "type": EVENT_TYPE_PREFIX + self.type,
            "subject": self.schedule_id,
            "time": iso_utc(self.time),
            "datacontenttype": "application/json",
            "data": {"schedule_id": self.schedule_id, "namespace": self.namespace, **self.data},
        }


@dataclass(frozen=True, slots=True)
class Subscription:
    """What a webhook receives: these event types, of a namespace or one schedule."""

    webhook_id: str
    events: frozenset[str]
    namespace: str
    schedule_id: str | None = None

    def covers(self, event: Event) -> bool:
        return (
            event.type in self.events
            and event.namespace == self.namespace
            and self.schedule_id in (None, event.schedule_id)
        )


def delivery_id(webhook_id: str, event_id: str) -> str:
    return f"{webhook_id}:{event_id}"


def body_of(event: Event) -> bytes:
    return json.dumps(event.cloudevent(), separators=(",", ":"), sort_keys=True).encode()


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The signature header's value for ``body`` sent at ``timestamp`` (unix seconds)."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"t={timestamp},v1={mac.hexdigest()}"


def verify(
    secret: str, header: str, body: bytes, now: float, tolerance_s: float = TOLERANCE_S
) -> bool:
    """Whether ``header`` signs ``body`` with ``secret``, made within ``tolerance_s`` of
    ``now`` (what a receiver checks; constant-time comparison)."""
    fields: dict[str, list[str]] = {}
    for part in header.split(","):
        key, _, value = part.strip().partition("=")
        fields.setdefault(key, []).append(value)
    try:
        timestamp = int(fields["t"][0])
    except (KeyError, ValueError):
        return False
    if abs(now - timestamp) > tolerance_s:
        return False
    expected = sign(secret, timestamp, body).rpartition("v1=")[2]
    return any(hmac.compare_digest(expected, given) for given in fields.get("v1", []))


def retry_in_s(attempts: int) -> float:
    """The wait after the ``attempts``-th failed attempt."""
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2.0 ** max(0, attempts - 1))
