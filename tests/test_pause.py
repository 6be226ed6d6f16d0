"""Pausing until an instant, decided by the pure core: nothing of the schedule is fired
before the instant, and its first fire from then on is queued (core/entries.py,
core/fire_queue.py)."""

from __future__ import annotations

import datetime as dt

from hascheduler.core.entries import Entry
from hascheduler.core.fire_queue import FireQueue, next_due
from hascheduler.core.triggers import Interval

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def at(s: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=s)


def entry(paused: bool, until: dt.datetime | None = None) -> Entry:
    return Entry(1, paused, Interval(1.0, T0), 0.0, "latest", 3600.0, "t", paused_until=until)


def test_paused_until_an_instant_is_paused_only_before_it() -> None:
    e = entry(True, at(10))
    assert e.paused_at(at(9.999))
    assert not e.paused_at(at(10))
    assert not e.dormant
    assert entry(True).dormant
    assert entry(True).paused_at(at(1000))
    assert not entry(False, None).paused_at(at(0))


def test_the_next_fire_of_a_schedule_paused_until_an_instant_is_at_it() -> None:
    due = next_due("s", entry(True, at(10)), at(2.5))
    assert due is not None
    assert due.nominal == at(10)
    later = next_due("s", entry(True, at(10)), at(12.5))
    assert later is not None
    assert later.nominal == at(13)


def test_the_queue_holds_a_schedule_paused_until_an_instant_and_drops_the_dormant() -> None:
    entries = {"until": entry(True, at(10)), "dormant": entry(True), "running": entry(False)}
    queue = FireQueue(entries)
    for _ in queue.seed(at(2.5), {}, {}):
        pass
    taken = queue.take_due(at(10), 100)
    assert [(d.schedule_id, d.nominal) for d in taken if d.schedule_id != "running"] == [
        ("until", at(10))
    ]
    assert all(d.schedule_id != "dormant" for d in taken)
