"""Reading a delivered message as a fire, and the stale-term rule (pure: no I/O)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from hascheduler.brokers.base import SUBJECT_PREFIX
from hascheduler.core.constants import MAX_TARGET_CHARS, TARGET_PATTERN
from hascheduler.core.fields import NAMESPACE, loads
from hascheduler.core.flow import ConcurrencyLimit, KeyTemplateError, RateLimit
from hascheduler.storage.run_records import FireRef

MAX_FIRE_ID_CHARS = 1024  # a schedule id (<= 128) and an instant, with room to spare
# W3C caps tracestate at 32 members of at most 256 characters each (traceparent is 55).
MAX_TRACE_FIELD_CHARS = 8192


class NotAFire(ValueError):
    """A message that is not one of our fires (hand-published, truncated, another
    producer's): it is terminated, never redelivered, never fatal."""


@dataclass(frozen=True, slots=True)
class Delivery:
    fire: FireRef
    term: int
    nominal_at: dt.datetime
    replay: int  # 0, or which replay of a dead run (POST /runs/{id}/retry) this is
    payload: Any
    tenant: str | None = None  # a fan-out fire's tenant key
    # W3C trace context of the fire's publish (the CloudEvent's distributed-tracing
    # extension); a malformed one is ignored where it is read (process/tracing.py).
    traceparent: str | None = None
    tracestate: str | None = None
    # The schedule's own flow limits (its ``concurrency`` and ``rate`` fields, in data).
    concurrency: ConcurrencyLimit | None = None
    rate: RateLimit | None = None
    priority: int = 0  # 0 to 9: higher first, under contention
    woken: bool = False  # sent again by the worker that freed a slot for it (parked)
    rate_granted: bool = False  # ... and the rate budget its waker took for it


def read_delivery(subject: str, body: bytes) -> Delivery:
    """Raises NotAFire saying what is wrong."""
    try:
        event = loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise NotAFire(f"not JSON: {exc}") from None
    if not isinstance(event, dict) or not isinstance(event.get("data"), dict):
        raise NotAFire("not a CloudEvent with an object in data")
    data = event["data"]
    fire_id, term, nominal, replay = (
        event.get("id"),
        data.get("term"),
        data.get("nominal_at"),
        data.get("replay", 0),
    )
    try:
        concurrency = (
            None if data.get("concurrency") is None else ConcurrencyLimit.of(data["concurrency"])
        )
        rate = None if data.get("rate") is None else RateLimit.of(data["rate"])
    except KeyTemplateError as exc:
        raise NotAFire(f"data: {exc}") from None
    priority = data.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 9:
        raise NotAFire("data.priority is not a whole number from 0 to 9")
    if not isinstance(fire_id, str) or not 0 < len(fire_id) <= MAX_FIRE_ID_CHARS:
        raise NotAFire("id is not a fire id")
    for name, value in (("term", term), ("replay", replay)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise NotAFire(f"data.{name} is not a whole number")
    if not isinstance(nominal, str):
        raise NotAFire("data.nominal_at is not an instant")
    try:
        nominal_at = dt.datetime.fromisoformat(nominal.replace("Z", "+00:00"))
    except ValueError:
        raise NotAFire("data.nominal_at is not an instant") from None
    if nominal_at.tzinfo is None:
        raise NotAFire("data.nominal_at has no offset")
    target = subject.removeprefix(SUBJECT_PREFIX + ".")
    # Bounded as the API bounds a schedule's: on RabbitMQ the target comes from a header,
    # as long as a frame, and the worker remembers the route of each target it meets.
    if len(target) > MAX_TARGET_CHARS or not TARGET_PATTERN.fullmatch(target):
        raise NotAFire(f"subject {subject[:200]!r} names no target")
    schedule_id = data.get("schedule_id")
    tenant = data.get("tenant")
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise NotAFire("data.tenant is not a tenant key")
    namespace = data.get("namespace")  # absent from a fire published before it was sent
    if namespace is not None and (
        not isinstance(namespace, str) or not NAMESPACE.fullmatch(namespace)
    ):
        raise NotAFire("data.namespace is not a namespace")
    return Delivery(
        fire=FireRef(
            fire_id=fire_id,
            target=target,
            schedule_id=schedule_id if isinstance(schedule_id, str) else fire_id.partition("@")[0],
            nominal_at=nominal_at.astimezone(dt.UTC),
            event=event,
            body=body,
            fire=fire_id.removesuffix(f"/{tenant}") if tenant else fire_id,
            tenant=tenant,
            namespace=namespace,
        ),
        term=term,
        nominal_at=nominal_at,
        replay=replay,
        payload=data.get("payload"),
        tenant=tenant,
        traceparent=_trace_field(event, "traceparent"),
        tracestate=_trace_field(event, "tracestate"),
        concurrency=concurrency,
        rate=rate,
        priority=priority,
        woken=data.get("woken") is True,
        rate_granted=data.get("woken") is True and data.get("rate_granted") is True,
    )


def _trace_field(event: dict[str, Any], name: str) -> str | None:
    value = event.get(name)
    return value if isinstance(value, str) and len(value) <= MAX_TRACE_FIELD_CHARS else None


class StaleFilter:
    """Drops a *stale* fire: one from a term older than a term this worker has already
    seen, whose nominal time is later than the moment it first saw that newer term. Such a
    fire can only come from a deposed leader acting after a newer one started; a fire an
    old leader claimed in time always has an earlier nominal time, so it still runs (its
    republish by the new leader was deduplicated away by the broker, so dropping it would
    lose it). A replay of a dead run is never stale: an operator asked for it; nor is a parked
    run woken (its fire was claimed in time: it waited for a slot)."""

    def __init__(self) -> None:
        self.first_seen_term: dict[int, dt.datetime] = {}
        self.max_term = 0

    def is_stale(self, delivery: Delivery, received_at: dt.datetime) -> bool:
        term = delivery.term
        if delivery.replay or delivery.woken:
            return False
        if term < self.max_term:
            newer_since = min(t for k, t in self.first_seen_term.items() if k > term)
            if delivery.nominal_at > newer_since:
                return True
        self.first_seen_term.setdefault(term, received_at)
        self.max_term = max(self.max_term, term)
        return False
