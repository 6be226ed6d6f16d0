"""Cron as crontab(5) reads it: our next fire times against two independent implementations
(cronsim, which follows Debian's cron, and croniter for ``nW``) over many expressions and
zones, the extensions' meaning by example, and impossible expressions refused."""

from __future__ import annotations

import datetime as dt
import random
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter
from cronsim import CronSim, CronSimError
from hypothesis import given, settings
from hypothesis import strategies as st

from hascheduler.core import cron
from hascheduler.core.triggers import Cron, InvalidTrigger, fire_times

UTC = dt.UTC
ZONES = [
    "UTC",
    "Europe/Paris",
    "America/New_York",
    "Asia/Kolkata",
    "Australia/Sydney",
    "Pacific/Chatham",
]
# Any fixed instants serve: these tests compare implementations, never the wall clock.
STARTS = [
    dt.datetime(2026, 1, 1, tzinfo=UTC),
    dt.datetime(2027, 2, 27, 23, 59, 58, tzinfo=UTC),
    dt.datetime(2031, 12, 31, 12, 34, 56, tzinfo=UTC),
]
FIXED = [
    "* * * * *",
    "*/5 * * * *",
    "0 9 * * mon",
    "0 9 1 * mon",
    "30 2 * * *",
    "0 0 1 1 *",
    "15 10 L * *",
    "0 0 LW * *",
    "0 12 * * 5L",
    "0 12 * * fri#2",
    "0 12 * * 1#5",
    "0 0 29 2 *",
    "0 0 30 2 mon",
    "0 0 * 2 mon#5",
    "0 0 L 2 *",
    "0 0 1,15 * sun",
    "0 0 */2 * mon",
    "0 0 1-7 * */2",
    "5/15 * * * *",
    "0 0 * * 7",
    "0 0 * * 5-7",
    "0 22 * * 1-5",
    "23 0-20/2 * * *",
    "0 0,12 1 */2 *",
    "0 0 L * 5L",
    "0 0 13 * fri",
    "*/20 * * * * *",
    "0 0 9 1 jan-mar,dec sat",
    "0 0 31 * *",
    "0 0 L * 0#1,3L",
]


def random_field(rng: random.Random, lo: int, hi: int, names: list[str] | None = None) -> str:
    def value() -> str:
        v = rng.randint(lo, hi)
        return names[v - lo] if names and rng.random() < 0.3 else str(v)

    kind = rng.choice(["*", "step", "value", "range", "range-step", "list", "list"])
    if kind == "*":
        return "*"
    if kind == "step":
        return f"*/{rng.randint(1, max(1, (hi - lo) // 2))}"
    if kind == "value":
        return value()
    a, b = sorted(rng.sample(range(lo, hi + 1), 2))
    if kind == "range":
        return f"{a}-{b}"
    if kind == "range-step":
        return f"{a}-{b}/{rng.randint(1, 5)}"
    return ",".join(sorted({value() for _ in range(rng.randint(2, 4))}))


def random_expression(rng: random.Random) -> str:
    minute = random_field(rng, 0, 59)
    hour = random_field(rng, 0, 23)
    dom = random_field(rng, 1, 31)
    if rng.random() < 0.2:
        dom = rng.choice(
            ["L", "LW", f"{dom.split('-')[0].split(',')[0]},L" if dom[0].isdigit() else "L"]
        )
    month = random_field(
        rng,
        1,
        12,
        ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"],
    )
    dow = random_field(rng, 0, 6, ["sun", "mon", "tue", "wed", "thu", "fri", "sat"])
    if rng.random() < 0.25:
        day = rng.randint(0, 6)
        dow = rng.choice([f"{day}L", f"{day}#{rng.randint(1, 5)}"])
    fields = [minute, hour, dom, month, dow]
    if rng.random() < 0.2:
        fields.insert(0, random_field(rng, 0, 59))
    return " ".join(fields)


RANDOM = [random_expression(random.Random(seed)) for seed in range(150)]


def offset_changes(tz: ZoneInfo, day: dt.date) -> bool:
    start = dt.datetime.combine(day, dt.time(), tz)
    end = start + dt.timedelta(days=1)
    return start.utcoffset() != end.utcoffset()


def cronsim_times(
    expression: str, tz: ZoneInfo, after: dt.datetime, count: int
) -> list[dt.datetime] | None:
    """Up to ``count`` fire times from cronsim; None when it finds the expression invalid
    or without a time in 50 years."""
    try:
        it = CronSim(expression, after.astimezone(tz))
        return [next(it).astimezone(UTC) for _ in range(count)]
    except (CronSimError, StopIteration):
        return None


def compare_away_from_dst(ours: list[dt.datetime], theirs: list[dt.datetime], tz: ZoneInfo) -> None:
    """Equal, but for times on days the zone's offset changes (our DST rule is our own and
    tested in test_triggers.py): compared up to the earlier of the two lists' ends."""
    horizon = min(ours[-1], theirs[-1])

    def kept(times: list[dt.datetime]) -> list[dt.datetime]:
        return [
            t for t in times if t <= horizon and not offset_changes(tz, t.astimezone(tz).date())
        ]

    assert kept(ours) == kept(theirs)


@pytest.mark.parametrize("expression", FIXED + RANDOM)
def test_next_fire_times_agree_with_cronsim_in_every_zone(expression: str) -> None:
    try:
        cron.parse(expression)
        refusal = ""
    except cron.CronError as exc:
        refusal = str(exc)
    if "'nL' and 'n#k'" in refusal:  # documented as not accepted
        assert expression.split()[-3].startswith("*/")
        return
    if refusal:  # refused as impossible: cronsim finds no time in 50 years either
        assert "can never fire" in refusal
        assert cronsim_times(expression, ZoneInfo("UTC"), STARTS[0], 1) is None
        return
    for name in ZONES:
        tz = ZoneInfo(name)
        for start in STARTS:
            ours = list(fire_times(Cron(expression, name), start, limit=12))
            theirs = cronsim_times(expression, tz, start, 12)
            assert theirs is not None, f"cronsim finds no time for {expression!r}"
            compare_away_from_dst(ours, theirs, tz)


@pytest.mark.parametrize(
    "expression",
    ["0 9 15W * *", "30 6 1W * *", "0 0 31W * *", "0 12 10W 2,3 *", "0 0 30W * *", "0 1 LW * *"],
)
@pytest.mark.parametrize("zone_name", ["UTC", "Asia/Kolkata"])
def test_nearest_weekday_agrees_with_croniter(expression: str, zone_name: str) -> None:
    tz = ZoneInfo(zone_name)
    for start in STARTS:
        ours = list(fire_times(Cron(expression, zone_name), start, limit=24))
        it = (
            croniter(expression.replace("LW", "L"), start.astimezone(tz))
            if "LW" not in expression
            else None
        )
        if it is None:  # croniter has no LW: cronsim does
            theirs = cronsim_times(expression, tz, start, 24)
            assert theirs is not None
        else:
            theirs = [it.get_next(dt.datetime).astimezone(UTC) for _ in range(24)]
        assert ours == theirs


def local(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text)


@pytest.mark.parametrize(
    ("expression", "after", "expected"),
    [
        # Day of month OR day of week when both are restricted: the 1st, and every Monday.
        (
            "0 9 1 * mon",
            "2026-05-30T00:00:00+00:00",
            [
                "2026-06-01T09:00:00+00:00",
                "2026-06-08T09:00:00+00:00",
                "2026-06-15T09:00:00+00:00",
                "2026-06-22T09:00:00+00:00",
                "2026-06-29T09:00:00+00:00",
                "2026-07-01T09:00:00+00:00",
            ],
        ),
        # One field starting with '*' makes it AND: every other day that is a Monday.
        (
            "0 9 */2 * mon",
            "2026-06-01T10:00:00+00:00",
            ["2026-06-15T09:00:00+00:00", "2026-06-29T09:00:00+00:00", "2026-07-13T09:00:00+00:00"],
        ),
        (
            "@hourly",
            "2026-06-01T10:30:00+00:00",
            ["2026-06-01T11:00:00+00:00", "2026-06-01T12:00:00+00:00"],
        ),
        (
            "@daily",
            "2026-06-01T10:30:00+00:00",
            ["2026-06-02T00:00:00+00:00", "2026-06-03T00:00:00+00:00"],
        ),
        (
            "@weekly",
            "2026-06-01T10:30:00+00:00",  # Sundays
            ["2026-06-07T00:00:00+00:00", "2026-06-14T00:00:00+00:00"],
        ),
        (
            "@monthly",
            "2026-06-01T10:30:00+00:00",
            ["2026-07-01T00:00:00+00:00", "2026-08-01T00:00:00+00:00"],
        ),
        (
            "@yearly",
            "2026-06-01T10:30:00+00:00",
            ["2027-01-01T00:00:00+00:00", "2028-01-01T00:00:00+00:00"],
        ),
        (
            "0 0 L * *",
            "2028-01-31T00:00:00+00:00",  # a leap February
            ["2028-02-29T00:00:00+00:00", "2028-03-31T00:00:00+00:00"],
        ),
        (
            "0 0 LW * *",
            "2026-01-01T00:00:00+00:00",  # 2026-01-31 is a Saturday
            ["2026-01-30T00:00:00+00:00", "2026-02-27T00:00:00+00:00"],
        ),
        (
            "0 0 * * 5L",
            "2026-01-01T00:00:00+00:00",  # the last Friday
            ["2026-01-30T00:00:00+00:00", "2026-02-27T00:00:00+00:00"],
        ),
        (
            "0 0 * * 5#2",
            "2026-01-01T00:00:00+00:00",  # the second Friday
            ["2026-01-09T00:00:00+00:00", "2026-02-13T00:00:00+00:00"],
        ),
        # 15W: 2026-08-15 is a Saturday (Friday the 14th), 2026-02-15 a Sunday (Monday 16th).
        (
            "0 0 15W * *",
            "2026-08-01T00:00:00+00:00",
            ["2026-08-14T00:00:00+00:00", "2026-09-15T00:00:00+00:00"],
        ),
        ("0 0 15W * *", "2026-02-01T00:00:00+00:00", ["2026-02-16T00:00:00+00:00"]),
        # 1W never leaves the month: 2026-08-01 is a Saturday, so Monday the 3rd.
        ("0 0 1W * *", "2026-07-15T00:00:00+00:00", ["2026-08-03T00:00:00+00:00"]),
        # Feb 29 on a Monday (the 5th Monday of February) first comes in 2044.
        ("0 0 * 2 mon#5", "2026-01-01T00:00:00+00:00", ["2044-02-29T00:00:00+00:00"]),
    ],
)
def test_crontab_forms_mean_what_crontab_says(
    expression: str, after: str, expected: list[str]
) -> None:
    times = list(fire_times(Cron(expression), local(after), limit=len(expected)))
    assert times == [local(t) for t in expected]


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("0 0 30 2 *", "can never fire"),
        ("1 0 30 2 *", "can never fire"),
        ("0 0 31 4,6,9,11 *", "can never fire"),
        ("0 0 31 apr *", "can never fire"),
        ("0 0 */31 * mon#2", "not with a stepped"),
        ("0 0 1-7/40 * *", "step 40"),
        ("0 0 * * 5#6", "week of the month is 1-5"),
        ("0 0 32W * *", "1-31"),
        ("@reboot", "unknown macro"),
        ("0 0 ? * ? ?", "stands only for a day field"),
        ("0 0 " + "1," * 200 + "2 * *", "at most 256 characters"),
        ("0 0 L-3 * *", "is not"),
        ("0 0 * * 8", "is not 0-7"),
    ],
)
def test_impossible_and_malformed_expressions_are_refused_with_a_reason(
    bad: str, reason: str
) -> None:
    with pytest.raises(cron.CronError, match=reason):
        cron.parse(bad)
    with pytest.raises(InvalidTrigger, match=reason):
        Cron(bad).next_after(STARTS[0])


@pytest.mark.parametrize(
    ("expression", "gap"),
    [
        ("* * * * * *", 1),
        ("*/5 * * * * *", 5),
        ("0,1 * * * * *", 1),
        ("0 * * * *", 3600),
        ("59 59 * * * *", 3600),
        ("0,30 * * * * *", 30),
        ("@daily", 3600),
        ("0,1 0 * * *", 60),
    ],
)
def test_min_gap_is_the_shortest_time_between_two_fires(expression: str, gap: int) -> None:
    assert cron.parse(expression).min_gap_s() == gap


def test_expressions_that_differ_only_in_spelling_parse_alike() -> None:
    assert cron.parse("0 9 * * MON-FRI").alternatives == cron.parse("0 9 * * 1-5").alternatives
    assert cron.parse("@daily") == cron.parse("0 0 * * *")
    assert cron.parse("0 0 * * 7").alternatives == cron.parse("0 0 * * sun").alternatives


# Anything a client can send: fields from cron's own alphabet, and arbitrary text.
CRON_TEXT = st.one_of(
    st.lists(
        st.text(alphabet="0123456789*/,-#?LWlw@ monfrijasd", min_size=1, max_size=12),
        min_size=1,
        max_size=7,
    ).map(" ".join),
    st.text(max_size=300),
)


@settings(max_examples=400, deadline=None)
@given(CRON_TEXT)
def test_any_text_parses_or_is_refused_with_a_reason_and_fires_if_accepted(text: str) -> None:
    try:
        parsed = cron.parse(text)
    except cron.CronError as exc:
        refusal = str(exc)
        parsed = None
    if parsed is None:
        assert refusal  # every refusal says why
        return
    nxt = Cron(parsed.text).next_after(STARTS[0])
    # Accepted means it can fire: within the calendar APScheduler covers (year 9999).
    assert nxt is not None
    assert parsed.min_gap_s() >= 1
