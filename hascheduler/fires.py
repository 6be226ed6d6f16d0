"""Fires: the ledger documents, the CloudEvents message, and the catch-up plan (pure)."""

from __future__ import annotations

import datetime as dt
import json
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


def cloud_event(*, fire: dict[str, Any], schedule: dict[str, Any], term: int, attempt: int,
                fired_at: dt.datetime) -> FireMessage:
    """CloudEvents 1.0, structured JSON mode; ``id`` is the fire id (the dedup key)."""
    nominal = fire["nominal_at"]
    event = {
        "specversion": "1.0", "id": fire["_id"], "source": EVENT_SOURCE, "type": EVENT_TYPE,
        "subject": fire["schedule_id"], "time": iso_utc(fired_at),
        "datacontenttype": "application/json",
        "data": {"schedule_id": fire["schedule_id"], "name": schedule.get("name"),
                 "nominal_at": iso_utc(nominal), "fired_at": iso_utc(fired_at),
                 "term": term, "attempt": attempt, "payload": schedule.get("payload", {})},
    }
    return FireMessage(fire_id=fire["_id"], target=schedule["target"], term=term,
                       body=json.dumps(event, separators=(",", ":")).encode())


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
