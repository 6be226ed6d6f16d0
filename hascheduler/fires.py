"""Fires: the ledger documents, the CloudEvents message, and the catch-up plan (pure)."""

from __future__ import annotations

import datetime as dt
import json
import json.encoder
from dataclasses import dataclass
from typing import Any

from .brokers import FireMessage
from .triggers import Trigger, fire_id, fire_times, iso_utc

# Ledger states.
CLAIMED = "claimed"
PUBLISHED = "published"
SKIPPED = "skipped"
FAILED = "failed"

EVENT_TYPE = "io.hascheduler.fire"
EVENT_SOURCE = "/hascheduler"
# A catch-up never plans more than this many fires for one schedule (a */1s cron after a
# day down would be 86400): the oldest beyond it are recorded as skipped.
MAX_CATCHUP_PER_SCHEDULE = 10_000


def claim_document(schedule_id: str, nominal: dt.datetime, due: dt.datetime, term: int,
                   now: dt.datetime) -> dict[str, Any]:
    return {"_id": fire_id(schedule_id, nominal), "schedule_id": schedule_id,
            "nominal_at": nominal, "due_at": due, "term": term, "state": CLAIMED,
            "claimed_at": now, "recorded_at": now, "attempts": 0,
            "next_attempt_at": now}


def skipped_document(schedule_id: str, nominal: dt.datetime, term: int, reason: str,
                     now: dt.datetime) -> dict[str, Any]:
    return {"_id": fire_id(schedule_id, nominal), "schedule_id": schedule_id,
            "nominal_at": nominal, "term": term, "state": SKIPPED, "reason": reason,
            "recorded_at": now}


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


def plan_catchup(trigger: Trigger, policy: str, window_s: float, since: dt.datetime,
                 now: dt.datetime) -> tuple[list[dt.datetime], list[tuple[dt.datetime, str]]]:
    """Nominal times in (since, now] no leader fired: which to fire now, which to skip.

    ``all`` fires those within ``window_s`` of now; ``latest`` only the most recent;
    ``none`` none. Every time not fired comes back with the reason it was skipped.
    """
    missed = list(fire_times(trigger, since, until=now, limit=MAX_CATCHUP_PER_SCHEDULE + 1))
    skipped: list[tuple[dt.datetime, str]] = []
    if len(missed) > MAX_CATCHUP_PER_SCHEDULE:
        skipped.append((missed.pop(0), "more missed fires than one catch-up replays"))
    if policy == "none":
        return [], skipped + [(n, "catch-up policy 'none'") for n in missed]
    if policy == "latest":
        return missed[-1:], skipped + [(n, "catch-up policy 'latest': a later time fired")
                                       for n in missed[:-1]]
    oldest = now - dt.timedelta(seconds=window_s)
    return ([n for n in missed if n >= oldest],
            skipped + [(n, "older than the catch-up window") for n in missed if n < oldest])


def backoff_s(attempt: int, base_s: float, cap_s: float, rand: float) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, base * 2^attempt))."""
    return float(rand * min(cap_s, base_s * 2 ** min(attempt, 30)))
