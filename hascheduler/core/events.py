"""The message a fire becomes: a CloudEvent, rendered from a per-schedule template (pure)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import json.encoder
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from hascheduler.core.fields import DEFAULT_NAMESPACE
from hascheduler.core.triggers import iso_utc

EVENT_TYPE = "io.hascheduler.fire"
EVENT_SOURCE = "/hascheduler"


class FireMessage(NamedTuple):
    """What the leader hands a broker for one fire. A named tuple: the cheapest immutable
    record to build, and the leader builds one per fire in the instant they fall due
    (a frozen dataclass sets each field through object.__setattr__)."""

    fire_id: str  # the broker's deduplication key (Nats-Msg-Id, AMQP message_id)
    target: str  # the schedule's target: subject suffix or routing key
    term: int
    body: bytes  # a CloudEvents 1.0 structured JSON document
    # W3C trace context of the fire's publish span (tracing on), also in the body: the
    # CloudEvents distributed-tracing extension. The brokers copy them to their headers.
    traceparent: str | None = None
    tracestate: str | None = None


_encode = json.JSONEncoder(separators=(",", ":")).encode
_quote = json.encoder.encode_basestring_ascii  # what json.dumps does to a str


@dataclass(frozen=True, slots=True)
class EventTemplate:
    """CloudEvents 1.0 in structured JSON mode, ``id`` the fire id (the dedup key): the
    schedule's part JSON-encoded once per revision.

    The leader renders 10,000 events a second at full load; encoding a whole dictionary
    per fire was an eighth of its CPU. ``render`` writes the very bytes ``json.dumps``
    of the event dictionary gives (compact separators, keys in this order), which
    tests/test_events.py checks against it."""

    target: str
    subject: str  # JSON: the schedule id
    name: str  # JSON
    payload: str  # JSON
    namespace: str = '"default"'  # JSON
    # The traceparent of the write that last changed the schedule (its fires link to it).
    written_in: str | None = None
    # The schedule's flow limits as data fields ('"concurrency":{...},"rate":{...},'), or "".
    flow: str = ""
    priority: int = 0

    @classmethod
    def of(cls, schedule: dict[str, Any]) -> EventTemplate:
        trace = schedule.get("trace")
        flow = "".join(
            f'"{name}":{_encode(schedule[name])},'
            for name in ("concurrency", "rate")
            if schedule.get(name)
        )
        priority = schedule.get("priority")
        return cls(
            target=schedule["target"],
            subject=_encode(schedule["_id"]),
            name=_encode(schedule.get("name")),
            payload=_encode(schedule.get("payload", {})),
            namespace=_encode(schedule.get("namespace") or DEFAULT_NAMESPACE),
            written_in=trace if isinstance(trace, str) else None,
            flow=flow,
            priority=priority if isinstance(priority, int) else 0,
        )

    def with_payload(self, payload: Any) -> EventTemplate:
        return dataclasses.replace(self, payload=_encode(payload))

    def with_priority(self, priority: int) -> EventTemplate:
        return dataclasses.replace(self, priority=priority)

    def render(
        self,
        fire_id: str,
        nominal_at: dt.datetime,
        tenant: str | None,
        term: int,
        attempt: int,
        fired_at_iso: str,
        trace: Mapping[str, str] | None = None,
    ) -> FireMessage:
        """``trace``: the publish span's ``traceparent`` (and ``tracestate``), if traced."""
        return self.prepare(fire_id, nominal_at, tenant, term, attempt, trace).message(
            fired_field(fired_at_iso)
        )

    def prepare(
        self,
        fire_id: str,
        nominal_at: dt.datetime,
        tenant: str | None,
        term: int,
        attempt: int,
        trace: Mapping[str, str] | None = None,
    ) -> PreparedEvent:
        """The event but for the instant it is fired at, which only its publish knows."""
        # A fan-out fire names its tenant (core/fanout.py); others have no such field.
        tenant_field = f'"tenant":{_quote(tenant)},' if tenant is not None else ""
        priority = f'"priority":{self.priority},' if self.priority else ""
        traceparent = tracestate = None
        trace_fields = ""
        if trace:
            traceparent, tracestate = trace.get("traceparent"), trace.get("tracestate")
            if traceparent:
                trace_fields = f'"traceparent":{_quote(traceparent)},'
            if tracestate:
                trace_fields += f'"tracestate":{_quote(tracestate)},'
        return PreparedEvent(
            fire_id,
            self.target,
            term,
            f'{{"specversion":"1.0","id":{_quote(fire_id)},"source":"{EVENT_SOURCE}",'
            f'"type":"{EVENT_TYPE}","subject":{self.subject},"time":'.encode(),
            (
                f',{trace_fields}"datacontenttype":"application/json","data":{{"schedule_id":'
                f'{self.subject},"name":{self.name},"namespace":{self.namespace},'
                f'"nominal_at":"{iso_utc(nominal_at)}",'
                '"fired_at":'
            ).encode(),
            (
                f',"term":{term},"attempt":{attempt},{tenant_field}{self.flow}{priority}'
                f'"payload":{self.payload}}}}}'
            ).encode(),
            traceparent,
            tracestate,
        )


@dataclass(frozen=True, slots=True)
class PreparedEvent:
    """An event rendered ahead of its due time, ``fired_at`` (twice in it) left out: the
    leader prepares the fires due together a quarter second early, so that their publish
    only joins the parts (10,000 fires due on one second were late by their rendering)."""

    fire_id: str
    target: str
    term: int
    head: bytes  # up to the CloudEvent's "time"
    middle: bytes  # from there up to data's "fired_at"
    tail: bytes
    traceparent: str | None = None
    tracestate: str | None = None

    def message(self, fired: bytes) -> FireMessage:
        """The message fired at ``fired`` (``fired_field``: one per publish, shared by its
        messages)."""
        return FireMessage(
            fire_id=self.fire_id,
            target=self.target,
            term=self.term,
            body=b"".join((self.head, fired, self.middle, fired, self.tail)),
            traceparent=self.traceparent,
            tracestate=self.tracestate,
        )


def fired_field(fired_at_iso: str) -> bytes:
    """The instant a publish fires its messages at, as PreparedEvent.message takes it."""
    return _quote(fired_at_iso).encode()


# Its length, the same for every instant of years 1000 to 9999 (iso_utc: milliseconds and
# a Z): a frame built ahead knows its size before the instant is joined in.
FIRED_FIELD_LEN = len(fired_field(iso_utc(dt.datetime(2000, 1, 1, tzinfo=dt.UTC))))
