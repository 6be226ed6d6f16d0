"""The leader's fire queue (pure): seeding, changes, taking due batches, jitter."""

from __future__ import annotations

import datetime as dt

import pytest

from hascheduler.core.entries import Entry, Written
from hascheduler.core.fire_queue import SEED_STEP, Due, FireQueue, next_due
from hascheduler.core.triggers import At, Interval

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def every(seconds: float, revision: int = 1, paused: bool = False, jitter: float = 0.0) -> Entry:
    return Entry(revision, paused, Interval(seconds, T0), jitter, "all", 3600.0, "t")


def seeded(entries: dict[str, Entry], now: dt.datetime) -> FireQueue:
    queue = FireQueue(entries)
    for _ in queue.seed(now, {}, {}):
        pass
    return queue


def taken(queue: FireQueue, horizon: dt.datetime, limit: int = 1000) -> list[tuple[str, float]]:
    return [
        (d.schedule_id, (d.nominal - T0).total_seconds()) for d in queue.take_due(horizon, limit)
    ]


def test_next_due_applies_deterministic_jitter_and_keeps_the_nominal() -> None:
    entry = every(60, jitter=30.0)
    due = next_due("s", entry, at(96))
    assert due is not None
    assert due.nominal == at(120)
    assert at(120) <= due.fire_at < at(150)
    assert next_due("s", entry, at(96)) == due
    # A nominal already passed whose jittered time has not: still due.
    assert next_due("s", entry, due.fire_at - dt.timedelta(milliseconds=1)) == due


@pytest.mark.parametrize(
    ("entries", "now", "horizon", "expected"),
    [
        # Each schedule's fires in time order, the following one queued as one is taken.
        (
            {"a": every(10), "b": every(15)},
            at(0),
            at(30),
            [("a", 10), ("b", 15), ("a", 20), ("a", 30), ("b", 30)],
        ),
        # Nothing after the horizon; nothing at or before "now" (the seed's instant).
        ({"a": every(10)}, at(10), at(25), [("a", 20)]),
        # A paused schedule is not queued.
        ({"a": every(10, paused=True), "b": every(10)}, at(0), at(10), [("b", 10)]),
        # A one-off fires once; after its instant it is gone.
        (
            {"o": Entry(1, False, At((at(5), at(7))), 0.0, "all", 3600.0, "t")},
            at(0),
            at(100),
            [("o", 5), ("o", 7)],
        ),
    ],
)
def test_take_due_in_time_order(
    entries: dict[str, Entry],
    now: dt.datetime,
    horizon: dt.datetime,
    expected: list[tuple[str, float]],
) -> None:
    assert taken(seeded(entries, now), horizon) == expected


def test_take_due_stops_at_its_limit_and_goes_on_from_there() -> None:
    queue = seeded({f"s{i}": every(10) for i in range(5)}, at(0))
    assert len(queue.take_due(at(10), 3)) == 3
    assert len(queue.take_due(at(10), 3)) == 2
    assert queue.take_due(at(10), 3) == []
    assert queue.first_at() == at(20)


def test_changes_drop_stale_items_and_queue_the_new_revision() -> None:
    entries = {"a": every(10), "b": every(10), "c": every(10)}
    queue = seeded(entries, at(0))
    entries["a"] = every(4, revision=2)  # edited: its old item is dropped, the new queued
    assert queue.changed("a", entries["a"], at(0))
    del entries["b"]  # deleted
    assert not queue.changed("b", None, at(0))
    entries["c"] = every(10, revision=2, paused=True)  # paused
    assert not queue.changed("c", entries["c"], at(0))
    assert taken(queue, at(10)) == [("a", 4), ("a", 8)]


def test_a_change_before_the_first_seed_waits_for_it() -> None:
    entries = {"a": every(10)}
    queue = FireQueue(entries)
    assert not queue.changed("a", entries["a"], None)
    assert len(queue) == 0
    for _ in queue.seed(at(0), {}, {}):
        pass
    assert taken(queue, at(10)) == [("a", 10)]


def test_seeding_steps_and_requeues_a_schedule_changed_meanwhile() -> None:
    entries = {f"s{i:05d}": every(60) for i in range(3 * SEED_STEP)}
    queue = FireQueue(entries)
    steps = 0
    for _ in queue.seed(at(15), {}, {}):
        steps += 1
        if steps == 1:  # s00000 was visited before the first step; now it changes
            entries["s00000"] = every(30, revision=2)
            assert not queue.changed("s00000", entries["s00000"], None)
    assert steps == 3
    queued = {(d.revision, d.nominal) for d in queue.items() if d.schedule_id == "s00000"}
    assert (2, at(30)) in queued, queued  # the new revision's next fire, every 30 s
    assert len(queue) >= len(entries)
    # The stale revision's item is dropped when it comes up.
    firsts = [d for d in queue.take_due(at(60), 10_000) if d.schedule_id == "s00000"]
    assert firsts == [Due(at(30), at(30), "s00000", 2), Due(at(60), at(60), "s00000", 2)]


def test_clear_empties_the_queue() -> None:
    queue = seeded({"a": every(10)}, at(0))
    queue.clear()
    assert len(queue) == 0
    assert queue.first_at() is None


def test_a_deferred_fire_comes_back_at_its_slot_without_queueing_its_schedule_twice() -> None:
    queue = seeded({"noisy": every(10), "quiet": every(10)}, at(0))
    first = queue.take_due(at(10), 10)
    assert [(d.schedule_id, d.nominal) for d in first] == [("noisy", at(10)), ("quiet", at(10))]
    queue.defer(first[0], at(25))  # its namespace's quota slot
    # What is due meanwhile is not held behind it; it comes back once, nominal unchanged.
    assert taken(queue, at(20)) == [("noisy", 20), ("quiet", 20)]
    back = queue.take_due(at(25), 10)
    assert [(d.schedule_id, d.nominal, d.fire_at) for d in back] == [("noisy", at(10), at(25))]
    assert taken(queue, at(30)) == [("noisy", 30), ("quiet", 30)]
    assert queue.first_at() == at(40)
    assert len(queue) == 2


def test_a_schedule_created_after_the_seeds_start_is_planned_from_its_creation() -> None:
    """``early_changes`` (the term's, still growing while it seeds) and ``created_since``
    (creations read): a schedule created after ``now`` has nothing due before its
    creation; one only changed is planned from ``now``; one created while the seed steps
    from its creation."""
    entries = {f"s{i:05d}": every(1) for i in range(2 * SEED_STEP)}
    early = {
        "s00000": Written(at(12.5), at(12.5)),  # created 2.5 s after the seed's start
        "s00001": Written(at(12.5), None),  # changed, not created
    }
    # Read, not seen: a creation another replica stamped after the seed's start.
    stamped = {"s00002": at(13.2)}
    queue = FireQueue(entries)
    for _ in queue.seed(at(10), early, stamped):
        early["s01999"] = Written(at(11.2), at(11.2))  # created while it steps
        assert not queue.changed("s01999", entries["s01999"], None)
    firsts = {
        d.schedule_id: d.nominal for d in queue.items() if d.schedule_id in {*early, *stamped}
    }
    assert firsts == {"s00000": at(13), "s00001": at(11), "s00002": at(14), "s01999": at(12)}
