"""Cron expressions as crontab(5) reads them: parsing, the day rule, and feasibility (pure).

What an expression means is decided here; the arithmetic of times of day, months and DST
stays APScheduler 3's CronTrigger (see core/triggers.py). Crontab fires when day-of-month *or*
day-of-week matches if both fields are restricted (neither starts with ``*``), and when both
match otherwise. One CronTrigger ANDs every field, so an expression is parsed into a union of
*alternatives*, each a conjunction one CronTrigger can say, and its next fire time is the
earliest of theirs. Extensions: ``L``, ``LW`` and ``nW`` in day-of-month, ``nL`` and ``n#k``
in day-of-week (APScheduler's own day expressions, plus one for ``W``), ``@`` macros, and an
optional leading seconds field.

Whether an alternative can ever fire depends only on its month, the month's length and the
weekday of the month's first day, and every such combination occurs in the 400-year
Gregorian cycle: checking them all (at most 13 x 7 months of 31 days) decides it exactly,
so an impossible expression is refused before any trigger searches for a time that does not
exist, and every accepted alternative finds its next day within decades, not millennia.
"""

from __future__ import annotations

import calendar
import datetime as dt
import functools
import itertools
import re
from dataclasses import dataclass

MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
# What every accepted expression looks like (the OpenAPI document's pattern): a macro, or
# five or six whitespace-separated fields of these characters.
SHAPE = r"^\s*(@[A-Za-z]+|[0-9A-Za-z*?/,#-]+(\s+[0-9A-Za-z*?/,#-]+){4,5})\s*$"
# Generous for any real expression; bounds the parser's work on hostile ones.
MAX_EXPRESSION_CHARS = 256

FIELD_NAMES = ("second", "minute", "hour", "day-of-month", "month", "day-of-week")
_BOUNDS = {
    "second": (0, 59),
    "minute": (0, 59),
    "hour": (0, 23),
    "day-of-month": (1, 31),
    "month": (1, 12),
    "day-of-week": (0, 7),
}
_MONTHS = {
    name: i + 1
    for i, name in enumerate(
        ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
    )
}
_CRON_DAYS = {name: i for i, name in enumerate(["sun", "mon", "tue", "wed", "thu", "fri", "sat"])}
# The lengths a month can have in some year (February: 28 or 29).
_LENGTHS = {m: (28, 29) if m == 2 else (calendar.monthrange(2001, m)[1],) for m in range(1, 13)}
_NTH = ("1st", "2nd", "3rd", "4th", "5th")
_WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")  # APScheduler's, Monday = 0
_TERM = re.compile(r"^(?P<base>\*|\?|[a-z0-9]+(?:-[a-z0-9]+)?)(?:/(?P<step>[0-9]+))?$")


class CronError(ValueError):
    """An expression that is not valid cron, or can never fire; the message says why."""


def nearest_weekday(day: int | None, length: int, first_weekday: int) -> int:
    """The weekday (Monday-Friday) nearest ``day`` within a month of ``length`` days whose
    first day is ``first_weekday`` (Monday = 0); ``None`` means the month's last weekday.

    A day past the month's end is read as its last day (as croniter and Quartz do). Never
    crosses into another month: a Saturday the 1st gives Monday the 3rd, a Sunday that ends
    the month gives Friday."""
    if day is None:
        last = length
        while (first_weekday + last - 1) % 7 >= 5:
            last -= 1
        return last
    day = min(day, length)
    weekday = (first_weekday + day - 1) % 7
    if weekday == 5:
        return day - 1 if day > 1 else day + 2
    if weekday == 6:
        return day + 1 if day < length else day - 2
    return day


@dataclass(frozen=True, slots=True)
class MonthDays:
    """Day-of-month conditions, any of which matches: numbers, L, LW and nW."""

    days: frozenset[int] = frozenset()
    last: bool = False
    last_weekday: bool = False
    nearest: frozenset[int] = frozenset()

    def matches(self, day: int, length: int, first_weekday: int) -> bool:
        return (
            day in self.days
            or (self.last and day == length)
            or (self.last_weekday and day == nearest_weekday(None, length, first_weekday))
            or any(day == nearest_weekday(n, length, first_weekday) for n in self.nearest)
        )

    def apscheduler(self) -> str:
        terms = [_ranges(self.days)] if self.days else []
        if self.last:
            terms.append("last")
        if self.last_weekday:
            terms.append("lw")
        terms.extend(f"{n}w" for n in sorted(self.nearest))
        return ",".join(terms)


@dataclass(frozen=True, slots=True)
class WeekDays:
    """Day-of-week conditions (Monday = 0), any of which matches: plain weekdays, or the
    positional forms ``nL`` (the month's last such weekday) and ``n#k`` (its k-th)."""

    weekdays: frozenset[int] = frozenset()
    last_of: frozenset[int] = frozenset()
    nth: frozenset[tuple[int, int]] = frozenset()

    @property
    def positional(self) -> bool:
        return bool(self.last_of or self.nth)

    def matches(self, day: int, length: int, first_weekday: int) -> bool:
        weekday = (first_weekday + day - 1) % 7
        return (
            weekday in self.weekdays
            or (weekday in self.last_of and day + 7 > length)
            or (weekday, (day - 1) // 7 + 1) in self.nth
        )

    def apscheduler_days(self) -> str:
        """The positional forms as APScheduler day-of-month expressions."""
        terms = [f"last {_WEEKDAYS[w]}" for w in sorted(self.last_of)]
        terms.extend(f"{_NTH[k - 1]} {_WEEKDAYS[w]}" for w, k in sorted(self.nth))
        return ",".join(terms)


@dataclass(frozen=True, slots=True)
class Alternative:
    """Days matching both conditions (a missing one matches every day) in ``months``."""

    months: frozenset[int]
    month_days: MonthDays | None = None
    week_days: WeekDays | None = None

    def matches(self, month: int, day: int, length: int, first_weekday: int) -> bool:
        return (
            month in self.months
            and (self.month_days is None or self.month_days.matches(day, length, first_weekday))
            and (self.week_days is None or self.week_days.matches(day, length, first_weekday))
        )

    def can_fire(self) -> bool:
        return any(
            self.matches(month, day, length, first)
            for month in self.months
            for length in _LENGTHS[month]
            for first in range(7)
            for day in range(1, length + 1)
        )


@dataclass(frozen=True, slots=True)
class CronExpression:
    """A parsed expression: the time-of-day sets and the union of day alternatives."""

    text: str
    seconds: tuple[int, ...]
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    alternatives: tuple[Alternative, ...]
    # DST: a wildcard hour follows elapsed time; any other hour names wall-clock times.
    wildcard_hour: bool

    def matches_day(self, month: int, day: int, length: int, first_weekday: int) -> bool:
        return any(a.matches(month, day, length, first_weekday) for a in self.alternatives)

    def first_day(self, alternative: Alternative, wall: dt.datetime) -> dt.date | None:
        """The first day at or after ``wall`` (naive) on which ``alternative`` fires at a
        time of day not before ``wall``'s: months outside the month field are stepped over
        whole, so a rare day (February 29th on a Monday) is found in a few hundred steps."""
        day = wall.date()
        last = (self.hours[-1], self.minutes[-1], self.seconds[-1])
        if (wall.hour, wall.minute, wall.second + (wall.microsecond > 0)) > last:
            if day == dt.date.max:
                return None
            day += dt.timedelta(days=1)
        year, month, start = day.year, day.month, day.day
        for _ in range(12 * 400 + 1):  # the calendar repeats every 400 years
            if month in alternative.months:
                first_weekday, length = calendar.monthrange(year, month)
                for candidate in range(start, length + 1):
                    if alternative.matches(month, candidate, length, first_weekday):
                        return dt.date(year, month, candidate)
            start, month = 1, month % 12 + 1
            year += month == 1
            if year > dt.MAXYEAR:
                return None
        return None

    def min_gap_s(self) -> int:
        """The shortest time between two consecutive fires, in seconds: within an hour,
        and across the hour's end (an upper bound on the shortest gap would let a floor be
        dodged; this is exact whenever consecutive hours both fire, else smaller)."""
        marks = sorted(m * 60 + s for m in self.minutes for s in self.seconds)
        gaps = [b - a for a, b in itertools.pairwise(marks)]
        gaps.append(3600 - marks[-1] + marks[0])
        return min(gaps)

    def trigger_fields(self) -> list[dict[str, str]]:
        """One APScheduler CronTrigger's field values per alternative."""
        out = []
        for alt in self.alternatives:
            day = "*"
            day_of_week = "*"
            if alt.month_days is not None:
                day = alt.month_days.apscheduler()
            if alt.week_days is not None:
                if alt.week_days.positional:
                    day = alt.week_days.apscheduler_days()
                else:
                    day_of_week = ",".join(_WEEKDAYS[w] for w in sorted(alt.week_days.weekdays))
            out.append(
                {
                    "second": _ranges(self.seconds),
                    "minute": _ranges(self.minutes),
                    "hour": _ranges(self.hours),
                    "day": day,
                    "month": _ranges(alt.months),
                    "day_of_week": day_of_week,
                }
            )
        return out


@functools.lru_cache(maxsize=4096)
def parse(expression: str) -> CronExpression:
    """Parse a 5-field (minute first) or 6-field (second first) expression or an ``@``
    macro. Raises CronError naming the field and the reason, including for an expression
    that can never fire."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CronError(f"a cron expression has at most {MAX_EXPRESSION_CHARS} characters")
    text = " ".join(expression.lower().split())
    if text.startswith("@"):
        if text not in MACROS:
            raise CronError(f"unknown macro {text!r} (use one of {', '.join(MACROS)})")
        text = MACROS[text]
    fields = text.split()
    if len(fields) == 5:
        fields = ["0", *fields]
    if len(fields) != 6:
        raise CronError(f"a cron expression has 5 or 6 fields, not {len(fields)}: {expression!r}")
    second, minute, hour, dom, month, dow = fields
    seconds = _numbers(second, "second")
    minutes = _numbers(minute, "minute")
    hours = _numbers(hour, "hour")
    months = frozenset(_numbers(month, "month"))
    month_days = _month_days(dom)
    week_days = _week_days(dow)
    dom_star, dow_star = dom[0] in "*?", dow[0] in "*?"
    alternatives = _alternatives(months, month_days, week_days, dom_star, dow_star)
    possible = tuple(a for a in alternatives if a.can_fire())
    if not possible:
        raise CronError(
            f"{expression!r} can never fire: no month in its month field has a "
            "day its day fields allow"
        )
    return CronExpression(
        text=" ".join(fields),
        seconds=tuple(seconds),
        minutes=tuple(minutes),
        hours=tuple(hours),
        alternatives=possible,
        wildcard_hour=hour == "*",
    )


def _alternatives(
    months: frozenset[int],
    month_days: MonthDays,
    week_days: WeekDays,
    dom_star: bool,
    dow_star: bool,
) -> list[Alternative]:
    every_day = month_days == MonthDays(days=frozenset(range(1, 32)))
    every_weekday = week_days == WeekDays(weekdays=frozenset(range(7)))
    plain = WeekDays(weekdays=week_days.weekdays) if week_days.weekdays else None
    positional = (
        WeekDays(last_of=week_days.last_of, nth=week_days.nth) if week_days.positional else None
    )
    weekday_parts = [Alternative(months, week_days=w) for w in (plain, positional) if w]
    if not (dom_star or dow_star):  # both restricted: either matches
        return [Alternative(months, month_days=month_days), *weekday_parts]
    if every_weekday:
        return [Alternative(months, month_days=None if every_day else month_days)]
    if every_day:
        return weekday_parts
    if positional is not None:
        raise CronError(
            "day-of-week forms 'nL' and 'n#k' combine with a day-of-month of "
            "'*' or a restricted one (either then matches), not with a stepped "
            "'*/n'"
        )
    return [Alternative(months, month_days=month_days, week_days=plain)]


def _numbers(text: str, name: str) -> list[int]:
    lo, hi = _BOUNDS[name]
    names = _MONTHS if name == "month" else _CRON_DAYS if name == "day-of-week" else {}
    values: set[int] = set()
    for term in text.split(","):
        match = _TERM.match(term)
        if not match:
            raise CronError(f"bad {name} field {text!r}: {term!r} is not a value, range or step")
        base, step_text = match["base"], match["step"]
        step = 1
        if step_text is not None:
            step = int(step_text)
            if not 1 <= step <= hi - lo + 1:
                raise CronError(
                    f"bad {name} field {text!r}: step {step} is not between 1 and {hi - lo + 1}"
                )
        if base in {"*", "?"}:
            if base == "?" and name not in {"day-of-month", "day-of-week"}:
                raise CronError(f"bad {name} field {text!r}: '?' stands only for a day field")
            first, last = lo, hi
        elif "-" in base:
            first_text, last_text = base.split("-", 1)
            first = _value(first_text, name, names, text)
            last = _value(last_text, name, names, text)
            if name == "day-of-week" and last == 0 and first > 0:
                last = 7  # "5-0": Friday to Sunday
            if first > last:
                raise CronError(f"bad {name} field {text!r}: range {base!r} runs backwards")
        else:
            first = _value(base, name, names, text)
            last = hi if step_text is not None else first  # "5/15": from 5 to the end
        values.update(range(first, last + 1, step))
    if name == "day-of-week":
        values = {v % 7 for v in values}
    return sorted(values)


def _value(text: str, name: str, names: dict[str, int], field_text: str) -> int:
    if text in names:
        return names[text]
    lo, hi = _BOUNDS[name]
    if text.isdigit() and lo <= int(text) <= hi:
        return int(text)
    hint = " or jan-dec" if name == "month" else " or sun-sat" if name == "day-of-week" else ""
    raise CronError(f"bad {name} field {field_text!r}: {text!r} is not {lo}-{hi}{hint}")


def _month_days(text: str) -> MonthDays:
    days: set[int] = set()
    last = last_weekday = False
    nearest: set[int] = set()
    plain = []
    for term in text.split(","):
        if term == "l":
            last = True
        elif term == "lw":
            last_weekday = True
        elif term.endswith("w") and term[:-1].isdigit():
            day = int(term[:-1])
            if not 1 <= day <= 31:
                raise CronError(f"bad day-of-month field {text!r}: {term!r} needs a day 1-31")
            nearest.add(day)
        else:
            plain.append(term)
    if plain:
        days.update(_numbers(",".join(plain), "day-of-month"))
    return MonthDays(frozenset(days), last, last_weekday, frozenset(nearest))


def _week_days(text: str) -> WeekDays:
    last_of: set[int] = set()
    nth: set[tuple[int, int]] = set()
    plain = []
    for term in text.split(","):
        if term.endswith("l") and len(term) > 1:
            last_of.add(_weekday(term[:-1], text))
        elif "#" in term:
            day_text, k_text = term.split("#", 1)
            if not (k_text.isdigit() and 1 <= int(k_text) <= 5):
                raise CronError(
                    f"bad day-of-week field {text!r}: in {term!r} the week of the month is 1-5"
                )
            nth.add((_weekday(day_text, text), int(k_text)))
        else:
            plain.append(term)
    weekdays = {(d + 6) % 7 for d in _numbers(",".join(plain), "day-of-week")} if plain else set()
    return WeekDays(frozenset(weekdays), frozenset(last_of), frozenset(nth))


def _weekday(text: str, field_text: str) -> int:
    """A cron weekday (0 or 7 = Sunday, or a name) as Monday = 0."""
    return (_value(text, "day-of-week", _CRON_DAYS, field_text) + 6) % 7


def _ranges(values: frozenset[int] | tuple[int, ...] | set[int]) -> str:
    """Sorted values as compact APScheduler ranges: 0-5,10,12-14."""
    ordered = sorted(values)
    parts = []
    start = prev = ordered[0]
    for v in ordered[1:]:
        if v != prev + 1:
            parts.append(f"{start}-{prev}" if prev > start else str(start))
            start = v
        prev = v
    parts.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(parts)
