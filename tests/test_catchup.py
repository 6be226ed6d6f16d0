"""The catch-up plan (pure): what a new leader fires after an outage of any length, and the
one range it records as skipped."""

from __future__ import annotations

import datetime as dt
import random

import pytest

from hascheduler.core.catchup import plan_catchup
from hascheduler.core.triggers import (
    Cron,
    Interval,
    Trigger,
    count_between,
    fire_times,
    latest_at_or_before,
)
from hascheduler.storage.fire_records import skipped_range_document
from tests.test_time_travel import next_offset_change

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
EVERY_MINUTE = Interval(60.0, T0)


def at(minutes: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


@pytest.mark.parametrize(
    ("policy", "window_s", "fired", "skipped", "reason"),
    [
        ("all", 3600, [1, 2, 3, 4, 5], None, ""),
        ("all", 150, [3, 4, 5], (1, 2, 2), "older than the catch-up window"),
        ("latest", 3600, [5], (1, 4, 4), "a later time fired"),
        ("none", 3600, [], (1, 5, 5), "policy 'none'"),
    ],
)
def test_catchup_policies(
    policy: str,
    window_s: float,
    fired: list[int],
    skipped: tuple[int, int, int] | None,
    reason: str,
) -> None:
    fire, skip = plan_catchup(EVERY_MINUTE, policy, window_s, at(0.5), at(5.5))
    assert fire == [at(m) for m in fired]
    if skipped is None:
        assert skip is None
    else:
        assert skip is not None
        assert (skip.first, skip.last, skip.count) == (at(skipped[0]), at(skipped[1]), skipped[2])
        assert reason in skip.reason


DAY = 86_400.0


@pytest.mark.parametrize(
    "trigger",
    [
        Cron("* * * * * *"),
        Cron("* * * * * *", "Europe/Paris"),
        Interval(1.0, T0 - dt.timedelta(days=500)),
    ],
)
@pytest.mark.parametrize("down_s", [DAY, 30 * DAY, 400 * DAY])
def test_latest_after_a_long_outage_fires_the_latest_missed_time(
    trigger: Trigger, down_s: float
) -> None:
    now = T0 + dt.timedelta(milliseconds=400)
    since = now - dt.timedelta(seconds=down_s)
    fire, skip = plan_catchup(trigger, "latest", 3600, since, now)
    assert fire == [T0]  # the last whole second before now, not one a day old
    assert skip is not None
    assert skip.last == T0 - dt.timedelta(seconds=1)
    assert skip.count == round(down_s) - 1  # every second of the outage but the one fired
    assert skip.first == next(iter(fire_times(trigger, since, limit=1)))


@pytest.mark.parametrize("down_s", [DAY, 30 * DAY, 400 * DAY])
def test_all_fires_exactly_the_window_and_records_the_rest_as_one_range(down_s: float) -> None:
    every_second = Interval(1.0, T0 - dt.timedelta(days=500))
    now = T0 + dt.timedelta(milliseconds=400)
    since = now - dt.timedelta(seconds=down_s)
    fire, skip = plan_catchup(every_second, "all", 600, since, now)
    window_start = now - dt.timedelta(seconds=600)
    assert fire == list(fire_times(every_second, window_start, until=now))
    assert len(fire) == 600
    assert fire[0] >= window_start
    assert fire[-1] == T0
    assert skip is not None
    assert skip.count == round(down_s) - 600
    assert skip.last == fire[0] - dt.timedelta(seconds=1)
    assert "window" in skip.reason


def test_count_and_latest_agree_with_listing_across_dst_and_odd_zones() -> None:
    rng = random.Random(7)
    cases: list[tuple[str, list[float]]] = [
        ("*/7 * * * * *", [10, 3600, 4 * 3600]),
        ("*/13 * 2 * * *", [3600, 86400]),
        ("30 2 * * *", [86400, 40 * DAY]),
        ("30 * * * *", [40 * DAY]),
        ("15,45 2,3 * * *", [86400, 40 * DAY]),
        ("0 9 1 * mon", [400 * DAY]),
        ("0 0 L * *", [400 * DAY]),
    ]
    for expression, spans in cases:
        for zone_name in [
            "Europe/Paris",
            "America/New_York",
            "Australia/Lord_Howe",
            "Pacific/Chatham",
            "UTC",
        ]:
            trigger = Cron(expression, zone_name)
            somewhere = T0 + dt.timedelta(seconds=rng.randint(0, 365 * 86400))
            # Spans that start just before a change of offset, and one anywhere.
            change = next_offset_change(zone_name, somewhere) if zone_name != "UTC" else somewhere
            for after in (somewhere, change - dt.timedelta(seconds=rng.randint(1, 7200))):
                until = after + dt.timedelta(seconds=rng.choice(spans))
                listed = list(fire_times(trigger, after, until=until))
                assert count_between(trigger, after, until) == len(listed)
                assert latest_at_or_before(trigger, after, until) == (
                    listed[-1] if listed else None
                )


def test_skipped_range_is_one_ledger_document() -> None:
    _, skip = plan_catchup(Cron("* * * * * *"), "none", 3600, T0, T0 + dt.timedelta(days=2))
    assert skip is not None
    doc = skipped_range_document("s", skip, 4, T0)
    assert doc["_id"] == "s@2030-01-01T00:00:01.000Z..2030-01-03T00:00:00.000Z"
    assert (doc["count"], doc["state"], doc["term"]) == (2 * 86400, "skipped", 4)
    assert doc["nominal_at"] == T0 + dt.timedelta(seconds=1)


def test_catchup_with_nothing_missed_is_empty() -> None:
    assert plan_catchup(EVERY_MINUTE, "all", 3600, at(5.1), at(5.9)) == ([], None)
    assert plan_catchup(EVERY_MINUTE, "latest", 3600, at(5.1), at(5.9)) == ([], None)
