"""When schedules fire: pure functions of a trigger specification and a point in time.

Cron arithmetic is APScheduler 3.x's CronTrigger (interned: one object per distinct
expression and zone, since each costs about 2.3 KB); intervals and instants are plain
arithmetic on UTC instants, so failover or restarts can never shift their phase.

DST rule for cron schedules (documented in docs/SCHEDULES.md, tested for Europe/Paris and
America/New_York):
- spring forward: a wall time inside the gap fires once, shifted forward by the gap's
  length (a daily 02:30 fires at 03:30 local on that day);
- fall back: when the hour field is ``*`` the schedule follows elapsed time and fires in
  both passes of the repeated hour; with a fixed hour, a wall time fires only at its first
  occurrence (a daily 02:30 fires once, at 02:30 summer time).
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.triggers.cron import CronTrigger

UTC = dt.UTC
_DOW_NAMES = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]
_DOW_ALIASES = {name: i for i, name in enumerate(_DOW_NAMES)}


class InvalidTrigger(ValueError):
    """A trigger specification that cannot fire as written; the message says why."""


def zone(name: str) -> ZoneInfo:
    """The IANA time zone; raises InvalidTrigger for an unknown name."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidTrigger(f"unknown time zone {name!r} (use an IANA name such as "
                             "'Europe/Paris')") from None


def _crontab_dow(field: str) -> str:
    """Crontab's day-of-week field (0 or 7 = Sunday) as APScheduler names.

    APScheduler 3 numbers days from Monday = 0, so "1" would silently mean Tuesday.
    """
    if field in {"*", "?"}:
        return "*"
    days: set[int] = set()
    for part in field.lower().split(","):
        step = 1
        if "/" in part:
            part, step_text = part.split("/", 1)
            if not step_text.isdigit() or int(step_text) == 0:
                raise InvalidTrigger(f"bad step in day-of-week field {field!r}")
            step = int(step_text)
        if part in {"*", "?"}:
            lo, hi = 0, 6
        elif "-" in part:
            lo_text, hi_text = part.split("-", 1)
            lo, hi = _dow_value(lo_text, field), _dow_value(hi_text, field)
            if hi == 0 and lo > 0:
                hi = 7  # "5-0" / "5-7": Friday to Sunday
        else:
            lo = hi = _dow_value(part, field)
            if step != 1:
                hi = 6
        if lo > hi:
            raise InvalidTrigger(f"day-of-week range {part!r} runs backwards")
        days.update(d % 7 for d in range(lo, hi + 1, step))
    return ",".join(_DOW_NAMES[d] for d in sorted(days))


def _dow_value(text: str, field: str) -> int:
    if text in _DOW_ALIASES:
        return _DOW_ALIASES[text]
    if text.isdigit() and 0 <= int(text) <= 7:
        return int(text)
    raise InvalidTrigger(f"bad day of week {text!r} in {field!r} (0-7 or sun-sat)")


@functools.lru_cache(maxsize=4096)
def cron_trigger(expression: str, timezone: str) -> CronTrigger:
    """The interned APScheduler trigger for a 5-field (minute first) or 6-field (second
    first) cron expression. Raises InvalidTrigger."""
    fields = expression.split()
    if len(fields) == 5:
        fields = ["0", *fields]
    if len(fields) != 6:
        raise InvalidTrigger(f"a cron expression has 5 or 6 fields, not {len(fields)}: "
                             f"{expression!r}")
    second, minute, hour, day, month, dow = fields
    try:
        return CronTrigger(second=second, minute=minute, hour=hour, day=day, month=month,
                           day_of_week=_crontab_dow(dow), timezone=zone(timezone))
    except InvalidTrigger:
        raise
    except (ValueError, TypeError) as exc:
        raise InvalidTrigger(f"invalid cron expression {expression!r}: {exc}") from None


def _second_pass_of_repeated_hour(moment: dt.datetime) -> bool:
    """True when ``moment``'s wall time also occurred one offset-change earlier."""
    tz = moment.tzinfo
    wall = moment.replace(tzinfo=None)
    first = wall.replace(fold=0, tzinfo=tz)
    second = wall.replace(fold=1, tzinfo=tz)
    if first.utcoffset() == second.utcoffset():
        return False
    return moment.astimezone(UTC) == second.astimezone(UTC) != first.astimezone(UTC)


@dataclass(frozen=True, slots=True)
class Cron:
    expression: str
    timezone: str = "UTC"

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        return _cron_next_after(self.expression, self.timezone, after)


# Many schedules share an expression, and the leader asks for all of them at the same
# instants (seeding the heap at one "now", fires due together, catch-up from one
# watermark): APScheduler's arithmetic costs tens of microseconds a call, a hit one.
@functools.lru_cache(maxsize=16384)
def _cron_next_after(expression: str, timezone: str, after: dt.datetime) -> dt.datetime | None:
    trigger = cron_trigger(expression, timezone)
    fixed_hour = expression.split()[-4] != "*"
    tz = trigger.timezone
    # Step in UTC: adding to an aware local time is wall-clock arithmetic, which is
    # ambiguous exactly at the DST transitions this must get right.
    start = after.astimezone(UTC) + dt.timedelta(microseconds=1)
    for _ in range(1000):
        nxt: dt.datetime | None = trigger.get_next_fire_time(None, start.astimezone(tz))
        if nxt is None:
            return None
        nxt_utc = nxt.astimezone(UTC)
        if fixed_hour and _second_pass_of_repeated_hour(nxt):
            start = nxt_utc + dt.timedelta(seconds=1)
            continue
        return nxt_utc
    raise InvalidTrigger(f"cron {expression!r} found no fire time")


@dataclass(frozen=True, slots=True)
class Interval:
    """Every ``every`` seconds on the grid start_at + k * every (k >= 0), until end_at."""

    every: float
    start_at: dt.datetime
    end_at: dt.datetime | None = None

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        if after < self.start_at:
            nxt = self.start_at
        else:
            k = math.floor((after - self.start_at).total_seconds() / self.every) + 1
            nxt = self.start_at + dt.timedelta(seconds=k * self.every)
            if nxt <= after:  # float rounding on the grid
                nxt += dt.timedelta(seconds=self.every)
        if self.end_at is not None and nxt > self.end_at:
            return None
        return nxt


@dataclass(frozen=True, slots=True)
class At:
    """Fires once at each of a sorted tuple of instants."""

    instants: tuple[dt.datetime, ...]

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        for instant in self.instants:
            if instant > after:
                return instant
        return None


Trigger = Cron | Interval | At


def fire_times(trigger: Trigger, after: dt.datetime, until: dt.datetime | None = None,
               limit: int | None = None) -> Iterator[dt.datetime]:
    """Nominal fire times strictly after ``after`` (and at or before ``until``), in order."""
    count = 0
    current = after
    while limit is None or count < limit:
        try:
            nxt = trigger.next_after(current)
        except OverflowError:
            return  # past year 9999: the calendar ends before the next fire
        if nxt is None or (until is not None and nxt > until):
            return
        yield nxt
        count += 1
        current = nxt


def jitter_offset(schedule_id: str, nominal: dt.datetime, jitter_s: float) -> dt.timedelta:
    """Deterministic offset in [0, jitter_s): every replica and preview agree on it."""
    if jitter_s <= 0:
        return dt.timedelta(0)
    digest = hashlib.sha256(f"{schedule_id}@{iso_utc(nominal)}".encode()).digest()
    fraction = int.from_bytes(digest[:8], "big") / 2**64
    return dt.timedelta(microseconds=int(fraction * jitter_s * 1_000_000) // 1000 * 1000)


@functools.lru_cache(maxsize=4096)  # fires due together share their instants
def iso_utc(moment: dt.datetime) -> str:
    """UTC ISO-8601 with milliseconds and a Z, the fire id's time format."""
    utc = moment if moment.tzinfo is UTC else moment.astimezone(UTC)
    # isoformat is several times faster than strftime; this runs for every fire.
    return utc.replace(tzinfo=None).isoformat(timespec="milliseconds") + "Z"


def fire_id(schedule_id: str, nominal: dt.datetime) -> str:
    return f"{schedule_id}@{iso_utc(nominal)}"


_ISO_DURATION = re.compile(
    r"^P(?:(?P<weeks>\d+(?:\.\d+)?)W)?(?:(?P<days>\d+(?:\.\d+)?)D)?"
    r"(?:T(?:(?P<hours>\d+(?:\.\d+)?)H)?(?:(?P<minutes>\d+(?:\.\d+)?)M)?"
    r"(?:(?P<seconds>\d+(?:\.\d+)?)S)?)?$")


def parse_duration(text: str) -> float:
    """Seconds in an ISO-8601 duration (weeks, days, hours, minutes, seconds).

    Years and months have no fixed length and are refused. Raises InvalidTrigger.
    """
    match = _ISO_DURATION.match(text.strip().upper())
    if not match or text.strip().upper() in {"P", "PT"} or text.strip().upper().endswith("T"):
        raise InvalidTrigger(f"{text!r} is not an ISO-8601 duration such as 'PT30S' or "
                             "'P1DT2H' (years and months are not allowed)")
    parts = {k: float(v) for k, v in match.groupdict().items() if v}
    return (parts.get("weeks", 0) * 604800 + parts.get("days", 0) * 86400
            + parts.get("hours", 0) * 3600 + parts.get("minutes", 0) * 60
            + parts.get("seconds", 0))
