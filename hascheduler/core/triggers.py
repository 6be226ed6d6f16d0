"""When schedules fire: pure functions of a trigger specification and a point in time.

Cron expressions mean what crontab(5) says (hascheduler/core/cron.py parses them into a union of
day alternatives); each alternative's arithmetic is APScheduler 3's CronTrigger (interned:
one object per distinct expression and zone, since each costs about 2.3 KB), extended with
one day-of-month expression for ``W``. Intervals and instants are plain arithmetic on UTC
instants, so failover or restarts can never shift their phase.

DST rule for cron schedules (documented in docs/SCHEDULES.md, tested for Europe/Paris and
America/New_York):
- spring forward: a wall time inside the gap fires once, shifted forward by the gap's
  length (a daily 02:30 fires at 03:30 local on that day);
- fall back: when the hour field is ``*`` the schedule follows elapsed time and fires in
  both passes of the repeated hour; with any other hour field, a wall time fires only at
  its first occurrence (a daily 02:30 fires once, at 02:30 summer time).
"""

from __future__ import annotations

import bisect
import calendar
import datetime as dt
import functools
import hashlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.cron.expressions import AllExpression
from apscheduler.triggers.cron.fields import DayOfMonthField

from hascheduler.core import cron

UTC = dt.UTC


class InvalidTrigger(ValueError):
    """A trigger specification that cannot fire as written; the message says why."""


@functools.cache
def zone_names() -> frozenset[str]:
    """The names the zone database on this machine knows, as the OpenAPI document lists
    them. Read when first asked: walking the database is most of this module's import
    otherwise, in processes that never name a zone."""
    return frozenset(available_timezones())


def zone(name: str) -> ZoneInfo:
    """The IANA time zone; raises InvalidTrigger for an unknown name."""
    try:
        if name not in zone_names():
            raise ValueError(name)
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidTrigger(
            f"unknown time zone {name!r} (use an IANA name such as 'Europe/Paris')"
        ) from None


class _NearestWeekdayExpression(AllExpression):  # type: ignore[misc]
    """``nW`` / ``LW`` as an APScheduler day-of-month expression (it has ``last`` and
    ``2nd fri`` of its own, but no nearest weekday)."""

    value_re = re.compile(r"(?P<day>[0-9]+|l)w$", re.IGNORECASE)

    def __init__(self, day: str) -> None:
        super().__init__(None)
        self.day = None if day.lower() == "l" else int(day)

    def validate_range(self, field_name: str) -> None:
        """cron.parse checked the day."""

    def get_next_value(self, date: dt.datetime, field: Any) -> int | None:
        first_weekday, length = calendar.monthrange(date.year, date.month)
        day = cron.nearest_weekday(self.day, length, first_weekday)
        return day if day >= date.day else None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NearestWeekdayExpression) and other.day == self.day

    def __hash__(self) -> int:
        return hash(self.day)

    def __str__(self) -> str:
        return f"{'l' if self.day is None else self.day}w"


class _DayOfMonthField(DayOfMonthField):  # type: ignore[misc]
    COMPILERS = [*DayOfMonthField.COMPILERS, _NearestWeekdayExpression]


class _CronTrigger(CronTrigger):  # type: ignore[misc]
    FIELDS_MAP = {**CronTrigger.FIELDS_MAP, "day": _DayOfMonthField}


@dataclass(frozen=True, slots=True)
class CompiledCron:
    """A cron expression's triggers (one per day alternative) and its zone.

    The triggers run on wall-clock time written as UTC (naive arithmetic on calendar
    fields); this module maps wall times to instants. APScheduler 3.11's own zone handling
    skips a month when its search crosses a DST change (a monthly "0 0 1 * *" in
    Europe/Paris asked from mid-March answers April 15th), and cannot express our DST rule.
    """

    expression: cron.CronExpression
    triggers: tuple[CronTrigger, ...]
    timezone: ZoneInfo

    def next_wall(self, wall: dt.datetime) -> dt.datetime | None:
        """The first wall time at or after ``wall`` (naive) the expression matches. Each
        alternative's trigger starts on the first day it fires (cron.first_day): left to
        search day by day, APScheduler took milliseconds for a rare day and a sixth of a
        second to give up on an impossible one."""
        times = []
        for alternative, trigger in zip(self.expression.alternatives, self.triggers, strict=True):
            day = self.expression.first_day(alternative, wall)
            if day is None:
                continue
            start = wall if day == wall.date() else dt.datetime.combine(day, dt.time())
            found = trigger.get_next_fire_time(None, start.replace(tzinfo=UTC))
            if found is not None:
                times.append(found)
        return min(times).replace(tzinfo=None) if times else None


@functools.lru_cache(maxsize=4096)
def compile_cron(expression: str, timezone: str) -> CompiledCron:
    """The interned triggers of a cron expression in a zone. Raises InvalidTrigger."""
    try:
        parsed = cron.parse(expression)
    except cron.CronError as exc:
        raise InvalidTrigger(str(exc)) from None
    tz = zone(timezone)
    return CompiledCron(
        parsed,
        tuple(_CronTrigger(**fields, timezone=UTC) for fields in parsed.trigger_fields()),
        tz,
    )


# No zone's offset changes twice within this span (DST changes are months apart; the
# largest single change is 2 hours), and none moves its clock by more than this.
_CHANGE_STEP = dt.timedelta(days=7)
_MAX_SHIFT = dt.timedelta(hours=3)
_TICK = dt.timedelta(microseconds=1)


def _offset(tz: ZoneInfo, moment: dt.datetime) -> dt.timedelta:
    offset = moment.astimezone(tz).utcoffset()
    assert offset is not None
    return offset


def _first_change(tz: ZoneInfo, start: dt.datetime, end: dt.datetime) -> dt.datetime | None:
    """The first instant in (start, end] at which ``tz``'s offset differs from its offset
    at ``start``, to the second; stepping a week at a time, then bisecting."""
    base = _offset(tz, start)
    lo = start
    while lo < end:
        hi = min(lo + _CHANGE_STEP, end)
        if _offset(tz, hi) != base:
            while hi - lo > dt.timedelta(seconds=1):
                mid = lo + (hi - lo) / 2
                if _offset(tz, mid) == base:
                    lo = mid
                else:
                    hi = mid
            # Offsets change on whole seconds, and (lo, hi] holds just one.
            edge = lo.replace(microsecond=0) + dt.timedelta(seconds=1)
            return edge if _offset(tz, edge) != base else hi
        lo = hi
    return None


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
    compiled = compile_cron(expression, timezone)
    start = after.astimezone(UTC) + _TICK
    tz = compiled.timezone
    candidates = []
    skip_walls_below = None
    # A change of offset just before ``start`` still shapes what follows it: the shifted
    # fires of a spring-forward gap, or the second pass of a repeated hour.
    recent = _first_change(tz, start - _MAX_SHIFT, start)
    if recent is not None:
        before, now_offset = _offset(tz, recent - _TICK), _offset(tz, recent)
        if now_offset > before:
            candidates.append(_gap_fire(compiled, recent, before, now_offset, start))
        elif not compiled.expression.wildcard_hour:
            skip_walls_below = _naive(recent) + before
    candidates.append(_regular_fire(compiled, start, skip_walls_below))
    return min((c for c in candidates if c is not None), default=None)


def _naive(moment: dt.datetime) -> dt.datetime:
    return moment.astimezone(UTC).replace(tzinfo=None)


def _gap_fire(
    compiled: CompiledCron,
    change: dt.datetime,
    before: dt.timedelta,
    after: dt.timedelta,
    start: dt.datetime,
) -> dt.datetime | None:
    """The first fire at or after ``start`` of a wall time skipped by the spring-forward
    change at ``change``: it fires shifted forward by the gap (read with the old offset)."""
    gap_start, gap_end = _naive(change) + before, _naive(change) + after
    wall = compiled.next_wall(max(gap_start, _naive(start) + before))
    if wall is None or wall >= gap_end:
        return None
    return (wall - before).replace(tzinfo=UTC)


def _regular_fire(
    compiled: CompiledCron, start: dt.datetime, skip_walls_below: dt.datetime | None
) -> dt.datetime | None:
    """The first fire at or after ``start``, walking one constant-offset stretch at a time."""
    tz = compiled.timezone
    for _ in range(1000):  # one turn per offset change crossed: two a year in DST zones
        offset = _offset(tz, start)
        wall = _naive(start) + offset
        if skip_walls_below is not None and wall < skip_walls_below:
            wall = skip_walls_below
        found = compiled.next_wall(wall)
        if found is None:
            return None
        # Walk the offset changes only near the answer: no fire lies between ``start`` and
        # three hours before where ``found`` lands (its wall time is the first that
        # matches), however many years apart they are.
        lands = found.replace(tzinfo=tz).astimezone(UTC)
        if lands - _MAX_SHIFT > start:
            start = lands - _MAX_SHIFT
            continue
        candidate = (found - offset).replace(tzinfo=UTC)
        change = _first_change(tz, start, candidate)
        if change is None:
            return candidate
        # The offset changes before the candidate: nothing fires in [start, change) (the
        # candidate was the first wall time at this offset), so go on from the change.
        new_offset = _offset(tz, change)
        skip_walls_below = None
        if new_offset > offset:
            gap = _gap_fire(compiled, change, offset, new_offset, change)
            rest = _regular_fire(compiled, change, None)
            return min((c for c in (gap, rest) if c is not None), default=None)
        if not compiled.expression.wildcard_hour:
            skip_walls_below = _naive(change) + offset  # fixed hours fire at first passes
        start = change
    raise InvalidTrigger(f"cron {compiled.expression.text!r} found no fire time")


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


def just_before(moment: dt.datetime) -> dt.datetime:
    """A microsecond before ``moment``, to ask for the fires from ``moment`` on (``moment``
    itself at the calendar's first instant, before which nothing lies)."""
    try:
        return moment - _TICK
    except OverflowError:
        return moment


@dataclass(frozen=True, slots=True)
class Bounded:
    """A cron or an instant list firing only within [start_at, end_at]."""

    inner: Cron | At
    start_at: dt.datetime | None = None
    end_at: dt.datetime | None = None

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        if self.start_at is not None and after < self.start_at:
            after = just_before(self.start_at)
        nxt = self.inner.next_after(after)
        if nxt is None or (self.end_at is not None and nxt > self.end_at):
            return None
        return nxt


Trigger = Cron | Interval | At | Bounded


def bounded(inner: Cron | At, start_at: dt.datetime | None, end_at: dt.datetime | None) -> Trigger:
    return inner if start_at is None and end_at is None else Bounded(inner, start_at, end_at)


def fire_times(
    trigger: Trigger, after: dt.datetime, until: dt.datetime | None = None, limit: int | None = None
) -> Iterator[dt.datetime]:
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


def latest_at_or_before(
    trigger: Trigger, after: dt.datetime, until: dt.datetime
) -> dt.datetime | None:
    """The last fire time in (after, until], found by bisecting time with next_after: a few
    dozen calls whatever the span (a catch-up after a year down costs what one after a
    minute does)."""
    first = next_fire(trigger, after)
    if first is None or first > until:
        return None
    lo, hi = first - _TICK, until  # a fire lies in (lo, until]; none in (hi, until]
    # Fire times are at least a millisecond apart, so (lo, hi] ends up holding just one.
    while hi - lo > dt.timedelta(microseconds=500):
        mid = lo + (hi - lo) / 2
        nxt = next_fire(trigger, mid)
        if nxt is not None and nxt <= until:
            lo = mid
        else:
            hi = mid
    return next_fire(trigger, lo)


def next_fire(trigger: Trigger, after: dt.datetime) -> dt.datetime | None:
    return next(iter(fire_times(trigger, after, limit=1)), None)


def count_between(trigger: Trigger, after: dt.datetime, until: dt.datetime) -> int:
    """How many fire times lie in (after, until], without listing them: arithmetic for
    intervals and instants; for cron, sums over the days, hours and minutes of the
    expression's sets, listing only the stretch after each change of offset (where the DST
    rule moves or drops fires)."""
    if until <= after:
        return 0
    if isinstance(trigger, Bounded):
        start = after if trigger.start_at is None else max(after, just_before(trigger.start_at))
        end = until if trigger.end_at is None else min(until, trigger.end_at)
        return count_between(trigger.inner, start, end)
    if isinstance(trigger, Interval):
        end = until if trigger.end_at is None else min(until, trigger.end_at)

        def at(k: int) -> dt.datetime:
            return trigger.start_at + dt.timedelta(seconds=k * trigger.every)

        last = math.floor((end - trigger.start_at).total_seconds() / trigger.every)
        while at(last + 1) <= end:  # float rounding, as in Interval.next_after
            last += 1
        while last >= 0 and at(last) > end:
            last -= 1
        first = max(0, math.floor((after - trigger.start_at).total_seconds() / trigger.every))
        while first > 0 and at(first - 1) > after:
            first -= 1
        while at(first) <= after:
            first += 1
        return max(0, last - first + 1)
    if isinstance(trigger, At):
        return bisect.bisect_right(trigger.instants, until) - bisect.bisect_right(
            trigger.instants, after
        )
    return _count_cron(compile_cron(trigger.expression, trigger.timezone), trigger, after, until)


def _count_cron(
    compiled: CompiledCron, trigger: Cron, after: dt.datetime, until: dt.datetime
) -> int:
    tz = compiled.timezone
    total = 0
    start = after
    while start < until:
        offset = _offset(tz, start + _TICK)
        change = _first_change(tz, start + _TICK, until)
        if change is None:
            return total + _count_walls(
                compiled.expression, _naive(start) + offset, _naive(until) + offset
            )
        # Before the change one offset holds, and wall times map one to one.
        total += _count_walls(
            compiled.expression, _naive(start) + offset, _naive(change - _TICK) + offset
        )
        # The shifted or repeated stretch after it is listed, the DST rule applied.
        shift = abs(_offset(tz, change) - offset)
        end = min(until, change + shift)
        total += sum(1 for _ in fire_times(trigger, change - _TICK, until=end))
        start = end
    return total


def _count_walls(expr: cron.CronExpression, after: dt.datetime, until: dt.datetime) -> int:
    """Matching wall times (naive) in (after, until]: whole days between, by month, then
    the parts of the first and last days."""
    if until <= after:
        return 0
    per_day = len(expr.hours) * len(expr.minutes) * len(expr.seconds)
    total = 0
    day = after.date()
    while day < until.date():  # the days from after's day up to until's, month by month
        first_weekday, length = calendar.monthrange(day.year, day.month)
        stop = until.day if (day.year, day.month) == (until.year, until.month) else length + 1
        total += per_day * sum(
            1 for d in range(day.day, stop) if expr.matches_day(day.month, d, length, first_weekday)
        )
        day = (
            dt.date(day.year + day.month // 12, day.month % 12 + 1, 1)
            if stop == length + 1
            else day.replace(day=stop)
        )
    return total + _fires_in_day_through(expr, until) - _fires_in_day_through(expr, after)


def _fires_in_day_through(expr: cron.CronExpression, wall: dt.datetime) -> int:
    """Matching wall times on ``wall``'s day at or before it."""
    first_weekday, length = calendar.monthrange(wall.year, wall.month)
    if not expr.matches_day(wall.month, wall.day, length, first_weekday):
        return 0
    h = bisect.bisect_left(expr.hours, wall.hour)
    total = h * len(expr.minutes) * len(expr.seconds)
    if h < len(expr.hours) and expr.hours[h] == wall.hour:
        m = bisect.bisect_left(expr.minutes, wall.minute)
        total += m * len(expr.seconds)
        if m < len(expr.minutes) and expr.minutes[m] == wall.minute:
            total += bisect.bisect_right(expr.seconds, wall.second)
    return total


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
    r"(?:(?P<seconds>\d+(?:\.\d+)?)S)?)?$"
)


# A duration as Go, Kubernetes and Temporal write one: numbers each with its unit, summed
# (30s, 5m, 1h30m, 250ms, 2d).
_SHORT_DURATION = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|d|h|m|s))+")
_SHORT_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|d|h|m|s)")
_SHORT_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
# Longer than any duration a person writes: refused before a pattern reads it.
MAX_DURATION_CHARS = 64


def parse_duration(text: str) -> float:
    """Seconds in an ISO-8601 duration (weeks, days, hours, minutes, seconds) or a short
    one (30s, 5m, 1h30m). Years and months have no fixed length and are refused. Raises
    InvalidTrigger."""
    value = text.strip()
    if len(value) <= MAX_DURATION_CHARS and _SHORT_DURATION.fullmatch(value):
        return sum(float(n) * _SHORT_UNITS[unit] for n, unit in _SHORT_PART.findall(value))
    value = value.upper()
    match = _ISO_DURATION.match(value) if len(value) <= MAX_DURATION_CHARS else None
    if not match or value in {"P", "PT"} or value.endswith("T"):
        raise InvalidTrigger(
            f"{text[:MAX_DURATION_CHARS]!r} is not a duration such as '30s', '1h30m', "
            "'PT30S' or 'P1DT2H' (years and months are not allowed)"
        )
    parts = {k: float(v) for k, v in match.groupdict().items() if v}
    return (
        parts.get("weeks", 0) * 604800
        + parts.get("days", 0) * 86400
        + parts.get("hours", 0) * 3600
        + parts.get("minutes", 0) * 60
        + parts.get("seconds", 0)
    )


def made_since(fire_at: dt.datetime, created_at: dt.datetime | None) -> bool:
    """Whether a fire due at ``fire_at`` (its jittered time) is one of a schedule created
    at ``created_at`` (None: not known): a schedule's fires are those due strictly after
    its creation, so an interval anchored at its creation does not fire at that instant.
    The one rule the live queue (next_due), the catch-up, the audit and /next keep."""
    return created_at is None or fire_at > created_at
