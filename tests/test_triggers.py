"""Fire-time arithmetic: tables of (trigger, after) -> expected nominal times."""

from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

import pytest

from hascheduler.core import triggers
from hascheduler.core.triggers import At, Cron, Interval, fire_times, jitter_offset

UTC = dt.UTC
PARIS = ZoneInfo("Europe/Paris")
NEW_YORK = ZoneInfo("America/New_York")


def local(times: list[dt.datetime], tz: ZoneInfo) -> list[str]:
    return [t.astimezone(tz).isoformat() for t in times]


@pytest.mark.parametrize(
    ("cron", "tz", "after", "expected"),
    [
        # Spring forward: 02:30 does not exist; it fires once, shifted by the gap, at 03:30.
        (
            "30 2 * * *",
            PARIS,
            "2026-03-28T12:00:00+01:00",
            ["2026-03-29T03:30:00+02:00", "2026-03-30T02:30:00+02:00"],
        ),
        (
            "30 2 * * *",
            NEW_YORK,
            "2026-03-07T12:00:00-05:00",
            ["2026-03-08T03:30:00-04:00", "2026-03-09T02:30:00-04:00"],
        ),
        # Fall back with a fixed hour: the repeated wall time fires once, at its first pass.
        (
            "30 2 * * *",
            PARIS,
            "2026-10-24T12:00:00+02:00",
            ["2026-10-25T02:30:00+02:00", "2026-10-26T02:30:00+01:00"],
        ),
        (
            "30 1 * * *",
            NEW_YORK,
            "2026-10-31T12:00:00-04:00",
            ["2026-11-01T01:30:00-04:00", "2026-11-02T01:30:00-05:00"],
        ),
        # Fall back with a wildcard hour: elapsed time, both passes fire.
        (
            "30 * * * *",
            PARIS,
            "2026-10-25T01:45:00+02:00",
            ["2026-10-25T02:30:00+02:00", "2026-10-25T02:30:00+01:00", "2026-10-25T03:30:00+01:00"],
        ),
        (
            "30 * * * *",
            NEW_YORK,
            "2026-11-01T00:45:00-04:00",
            ["2026-11-01T01:30:00-04:00", "2026-11-01T01:30:00-05:00", "2026-11-01T02:30:00-05:00"],
        ),
        # Asked after the change, inside the shifted hour: the skipped 02:30 is still to come.
        (
            "30 2 * * *",
            PARIS,
            "2026-03-29T03:10:00+02:00",
            ["2026-03-29T03:30:00+02:00", "2026-03-30T02:30:00+02:00"],
        ),
        # Gap times and real times after the gap interleave by instant.
        (
            "15,45 2,3 * * *",
            PARIS,
            "2026-03-29T01:00:00+01:00",
            ["2026-03-29T03:15:00+02:00", "2026-03-29T03:45:00+02:00", "2026-03-30T02:15:00+02:00"],
        ),
        # Asked during the second pass of a fixed hour: nothing more fires in it.
        ("30 2 * * *", PARIS, "2026-10-25T02:10:00+01:00", ["2026-10-26T02:30:00+01:00"]),
        # Every second of 01:xx: the second pass is stepped over in one go.
        (
            "* * 1 * * *",
            NEW_YORK,
            "2026-11-01T01:59:59-04:00",
            ["2026-11-02T01:00:00-05:00", "2026-11-02T01:00:01-05:00"],
        ),
        # A search that crosses a change lands on the right day (APScheduler 3.11 in the zone
        # answered April 15th here).
        (
            "0 0 1,15 * *",
            PARIS,
            "2027-03-15T00:00:00+01:00",
            ["2027-04-01T00:00:00+02:00", "2027-04-15T00:00:00+02:00"],
        ),
        (
            "0 0 1 * *",
            NEW_YORK,
            "2026-10-15T00:00:00-04:00",
            ["2026-11-01T00:00:00-04:00", "2026-12-01T00:00:00-05:00"],
        ),
    ],
)
def test_cron_dst_rule(cron: str, tz: ZoneInfo, after: str, expected: list[str]) -> None:
    times = list(
        fire_times(Cron(cron, str(tz)), dt.datetime.fromisoformat(after), limit=len(expected))
    )
    assert local(times, tz) == expected


@pytest.mark.parametrize(
    ("cron", "after", "expected"),
    [
        ("0 9 * * 1", "2026-11-21T00:00:00+00:00", "2026-11-23T09:00:00+00:00"),  # Monday
        ("0 9 * * 0", "2026-11-21T00:00:00+00:00", "2026-11-22T09:00:00+00:00"),  # Sunday
        ("0 9 * * 7", "2026-11-21T00:00:00+00:00", "2026-11-22T09:00:00+00:00"),  # Sunday too
        ("0 9 * * mon-fri", "2026-11-21T00:00:00+00:00", "2026-11-23T09:00:00+00:00"),
        ("0 9 * * 5-0", "2026-11-21T10:00:00+00:00", "2026-11-22T09:00:00+00:00"),  # Fri..Sun
        ("*/15 * * * * *", "2026-11-21T00:00:07+00:00", "2026-11-21T00:00:15+00:00"),
        ("0 0 29 2 *", "2026-03-01T00:00:00+00:00", "2028-02-29T00:00:00+00:00"),
    ],
)
def test_cron_fields_follow_crontab(cron: str, after: str, expected: str) -> None:
    nxt = Cron(cron).next_after(dt.datetime.fromisoformat(after))
    assert nxt is not None
    assert nxt.isoformat() == expected


@pytest.mark.parametrize(
    "bad", ["61 * * * *", "* * *", "* * * * * * *", "0 9 * * 8", "0 9 * * 5-2x", "*/0 * * * *"]
)
def test_bad_cron_is_refused_with_a_reason(bad: str) -> None:
    with pytest.raises(triggers.InvalidTrigger):
        triggers.compile_cron(bad, "UTC")


def test_unknown_time_zone_is_refused() -> None:
    with pytest.raises(triggers.InvalidTrigger, match="unknown time zone"):
        triggers.zone("Mars/Olympus_Mons")


def test_interval_is_anchored_to_its_start_and_never_shifts() -> None:
    start = dt.datetime(2026, 1, 1, 0, 0, 0, 500_000, tzinfo=UTC)
    every = Interval(30.0, start)
    # Whatever moment we ask from (a failover, a restart), the grid stays start + k*30 s.
    assert every.next_after(start - dt.timedelta(days=1)) == start
    for after in (
        start,
        start + dt.timedelta(seconds=29.9),
        start + dt.timedelta(hours=5, seconds=1),
    ):
        nxt = every.next_after(after)
        assert nxt is not None
        assert nxt > after
        assert (nxt - start).total_seconds() % 30 == 0
        assert (nxt - after).total_seconds() <= 30


def test_interval_stops_at_end() -> None:
    start = dt.datetime(2026, 1, 1, tzinfo=UTC)
    ending = Interval(60.0, start, start + dt.timedelta(minutes=2))
    assert list(fire_times(ending, start - dt.timedelta(seconds=1))) == [
        start,
        start + dt.timedelta(minutes=1),
        start + dt.timedelta(minutes=2),
    ]


def test_at_instants_in_order_then_nothing() -> None:
    a, b = dt.datetime(2030, 1, 1, tzinfo=UTC), dt.datetime(2030, 6, 1, tzinfo=UTC)
    assert list(fire_times(At((a, b)), dt.datetime(2029, 1, 1, tzinfo=UTC))) == [a, b]
    assert At((a,)).next_after(a) is None


def test_jitter_is_deterministic_bounded_and_spread() -> None:
    nominal = dt.datetime(2030, 1, 1, tzinfo=UTC)
    first = jitter_offset("s1", nominal, 30.0)
    assert jitter_offset("s1", nominal, 30.0) == first
    offsets = {jitter_offset("s1", nominal + dt.timedelta(minutes=i), 30.0) for i in range(200)}
    assert all(dt.timedelta(0) <= o < dt.timedelta(seconds=30) for o in offsets)
    assert len(offsets) > 150, "offsets should spread over the window"
    assert jitter_offset("s1", nominal, 0) == dt.timedelta(0)


def test_fire_id_is_schedule_and_utc_nominal_time() -> None:
    moment = dt.datetime(2030, 1, 1, 10, 0, 0, 123_456, tzinfo=PARIS)
    assert triggers.fire_id("weekly", moment) == "weekly@2030-01-01T09:00:00.123Z"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("PT30S", 30),
        ("PT1H", 3600),
        ("P1DT2H", 93600),
        ("P2W", 1209600),
        ("PT0.5S", 0.5),
        ("30s", 30),
        ("5m", 300),
        ("1h30m", 5400),
        ("250ms", 0.25),
        ("2d", 172800),
        (" 1.5h ", 5400),
    ],
)
def test_iso_and_short_durations(text: str, seconds: float) -> None:
    assert triggers.parse_duration(text) == seconds


@pytest.mark.parametrize(
    "bad",
    [
        "P1M",
        "P1Y",
        "PT",
        "P",
        "P1DT",
        "5 minutes",
        "1h30",
        "5M",
        "m5",
        "-5s",
        "1m" * 40,
        "1" * 10_000,
    ],
)
def test_bad_durations(bad: str) -> None:
    with pytest.raises(triggers.InvalidTrigger) as refused:
        triggers.parse_duration(bad)
    assert len(str(refused.value)) < 200  # a long input is not echoed whole
