"""Count fires from the broker stream against what the schedules say was due (pure part).

The stream is read by the caller; this module only compares. Each (schedule, nominal time)
whose due time falls in the window must appear exactly once.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hascheduler.core.entries import entry_from_document
from hascheduler.core.instants import as_utc
from hascheduler.core.triggers import fire_times, jitter_offset, made_since

FireKey = tuple[str, str]  # (schedule id, nominal time as ISO-8601)


@dataclass
class AuditReport:
    since: dt.datetime
    until: dt.datetime
    expected: int = 0
    delivered: int = 0
    missing: list[FireKey] = field(default_factory=list)
    duplicated: list[FireKey] = field(default_factory=list)
    unexpected: list[FireKey] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicated or self.unexpected)

    def as_dict(self) -> dict[str, Any]:
        return {
            "since": self.since.isoformat(),
            "until": self.until.isoformat(),
            "expected": self.expected,
            "delivered": self.delivered,
            "missing": len(self.missing),
            "duplicated": len(self.duplicated),
            "unexpected": len(self.unexpected),
            "ok": self.ok,
            "examples": {
                "missing": [list(k) for k in self.missing[:5]],
                "duplicated": [list(k) for k in self.duplicated[:5]],
                "unexpected": [list(k) for k in self.unexpected[:5]],
            },
        }


def describe(report: dict[str, Any]) -> str:
    """One line for people from AuditReport.as_dict()."""
    return (
        f"fires due {report['since']} .. {report['until']}: expected "
        f"{report['expected']}, delivered {report['delivered']}, missing "
        f"{report['missing']}, duplicated {report['duplicated']}, unexpected "
        f"{report['unexpected']}"
    )


def parse_instant(text: str) -> dt.datetime:
    """An ISO-8601 instant with a UTC offset (or Z), in UTC. Raises ValueError."""
    value = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    if value.tzinfo is None:
        raise ValueError(f"{text!r} has no UTC offset")
    return value.astimezone(dt.UTC)


def _key_time(moment: dt.datetime) -> str:
    return moment.isoformat(timespec="milliseconds")


def expected_fires(
    schedules: list[dict[str, Any]], since: dt.datetime, until: dt.datetime
) -> dict[FireKey, dt.datetime]:
    """Every unpaused schedule's fires due in [since, until], with their due times: only
    those due after its creation (made_since: the scheduler's own rule)."""
    due: dict[FireKey, dt.datetime] = {}
    for doc in schedules:
        entry = entry_from_document(doc)
        if entry.paused:
            continue
        created = doc.get("created_at")
        created = as_utc(created) if isinstance(created, dt.datetime) else None
        start = since - dt.timedelta(seconds=entry.jitter) - dt.timedelta(microseconds=1)
        for nominal in fire_times(entry.trigger, start, until=until, limit=100_000):
            at = nominal + jitter_offset(doc["_id"], nominal, entry.jitter)
            if since <= at <= until and made_since(at, created):
                due[(doc["_id"], _key_time(nominal.astimezone(dt.UTC)))] = at
    return due


def audit(
    schedules: list[dict[str, Any]],
    events: list[dict[str, Any]],
    since: dt.datetime,
    until: dt.datetime,
) -> AuditReport:
    """Compare CloudEvents read from the stream with the fires due in the window."""
    expected = expected_fires(schedules, since, until)
    entries = {doc["_id"]: entry_from_document(doc) for doc in schedules}
    jitters = {sid: e.jitter for sid, e in entries.items() if not e.paused}
    seen: Counter[FireKey] = Counter()
    for event in events:
        data = event.get("data") or {}
        sid, nominal = data.get("schedule_id"), data.get("nominal_at")
        if not isinstance(sid, str) or not isinstance(nominal, str):
            continue
        with contextlib.suppress(ValueError):
            seen[(sid, _key_time(parse_instant(nominal)))] += 1
    report = AuditReport(since, until, expected=len(expected))
    for key, count in seen.items():
        in_window = key in expected
        if in_window:
            report.delivered += 1
        if count > 1 and in_window:
            report.duplicated.append(key)
        if not in_window and key[0] in jitters:  # a fire no trigger asked for
            nominal = dt.datetime.fromisoformat(key[1])
            if since <= nominal + jitter_offset(key[0], nominal, jitters[key[0]]) <= until:
                report.unexpected.append(key)
    report.missing = sorted(k for k in expected if k not in seen)
    return report
