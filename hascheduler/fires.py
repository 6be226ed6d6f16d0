"""Fires: the ledger documents, the CloudEvents message, and the catch-up plan (pure)."""

from __future__ import annotations

import datetime as dt
import json
import json.encoder
from dataclasses import dataclass
from typing import Any

from .brokers import FireMessage
from .triggers import (
    Trigger,
    count_between,
    fire_id,
    fire_times,
    iso_utc,
    latest_at_or_before,
)

# Ledger states.
CLAIMED = "claimed"
PUBLISHED = "published"
SKIPPED = "skipped"
FAILED = "failed"

EVENT_TYPE = "io.hascheduler.fire"
EVENT_SOURCE = "/hascheduler"
# What one catch-up may replay for one schedule with policy 'all' (its window over its
# shortest gap between fires): a schedule asking for more is refused when written.
MAX_CATCHUP_FIRES = 100_000


def claim_document(schedule_id: str, nominal: dt.datetime, due: dt.datetime, term: int,
                   now: dt.datetime) -> dict[str, Any]:
    return {"_id": fire_id(schedule_id, nominal), "schedule_id": schedule_id,
            "nominal_at": nominal, "due_at": due, "term": term, "state": CLAIMED,
            "claimed_at": now, "recorded_at": now, "attempts": 0,
            "next_attempt_at": now}


_encode = json.JSONEncoder(separators=(",", ":")).encode
_quote = json.encoder.encode_basestring_ascii  # what json.dumps does to a str


@dataclass(frozen=True, slots=True)
class EventTemplate:
    """CloudEvents 1.0 in structured JSON mode, ``id`` the fire id (the dedup key): the
    schedule's part JSON-encoded once per revision.

    The leader renders 10,000 events a second at full load; encoding a whole dictionary
    per fire was an eighth of its CPU. ``render`` writes the very bytes ``json.dumps``
    of the event dictionary gives (compact separators, keys in this order), which
    tests/test_fires.py checks against it."""

    target: str
    subject: str  # JSON: the schedule id
    name: str     # JSON
    payload: str  # JSON

    @classmethod
    def of(cls, schedule: dict[str, Any]) -> EventTemplate:
        return cls(target=schedule["target"], subject=_encode(schedule["_id"]),
                   name=_encode(schedule.get("name")),
                   payload=_encode(schedule.get("payload", {})))

    def render(self, fire: dict[str, Any], term: int, attempt: int,
               fired_at_iso: str) -> FireMessage:
        fired = _quote(fired_at_iso)
        body = (f'{{"specversion":"1.0","id":{_quote(fire["_id"])},"source":"{EVENT_SOURCE}",'
                f'"type":"{EVENT_TYPE}","subject":{self.subject},"time":{fired},'
                f'"datacontenttype":"application/json","data":{{"schedule_id":{self.subject},'
                f'"name":{self.name},"nominal_at":"{iso_utc(fire["nominal_at"])}",'
                f'"fired_at":{fired},"term":{term},"attempt":{attempt},'
                f'"payload":{self.payload}}}}}')
        return FireMessage(fire_id=fire["_id"], target=self.target, term=term,
                           body=body.encode())


@dataclass(frozen=True, slots=True)
class SkippedRange:
    """Missed fire times not fired, recorded as one ledger document: the first and last
    nominal times, how many there were, and why."""

    first: dt.datetime
    last: dt.datetime
    count: int
    reason: str

    def document(self, schedule_id: str, term: int, now: dt.datetime) -> dict[str, Any]:
        return {"_id": f"{fire_id(schedule_id, self.first)}..{iso_utc(self.last)}",
                "schedule_id": schedule_id, "nominal_at": self.first,
                "last_nominal_at": self.last, "count": self.count, "term": term,
                "state": SKIPPED, "reason": self.reason, "recorded_at": now}


def plan_catchup(trigger: Trigger, policy: str, window_s: float, since: dt.datetime,
                 now: dt.datetime) -> tuple[list[dt.datetime], SkippedRange | None]:
    """Nominal times in (since, now] no leader fired: which to fire now, and the range of
    those skipped with its reason.

    ``all`` fires those within ``window_s`` of now; ``latest`` only the most recent;
    ``none`` none. The work is proportional to what is fired, not to the outage: the
    latest time is found by bisection and the skipped ones are counted, not listed.
    """
    if policy == "all":
        oldest = now - dt.timedelta(seconds=window_s)
        fire = list(fire_times(trigger, max(since, oldest - _TICK), until=now))
        return fire, _skipped(trigger, since, min(oldest - _TICK, now),
                              "older than the catch-up window")
    if policy == "latest":
        latest = latest_at_or_before(trigger, since, now)
        if latest is None:
            return [], None
        return [latest], _skipped(trigger, since, latest - _TICK,
                                  "catch-up policy 'latest': a later time fired")
    return [], _skipped(trigger, since, now, "catch-up policy 'none'")


_TICK = dt.timedelta(microseconds=1)


def _skipped(trigger: Trigger, after: dt.datetime, until: dt.datetime,
             reason: str) -> SkippedRange | None:
    first = next(iter(fire_times(trigger, after, until=until, limit=1)), None)
    if first is None:
        return None
    last = latest_at_or_before(trigger, after, until)
    assert last is not None
    return SkippedRange(first, last, count_between(trigger, after, until), reason)


def backoff_s(attempt: int, base_s: float, cap_s: float, rand: float) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, base * 2^attempt))."""
    return float(rand * min(cap_s, base_s * 2 ** min(attempt, 30)))
