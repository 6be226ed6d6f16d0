"""Pure firing logic: catch-up plans, backoff, the worker's filter, lease timings."""

from __future__ import annotations

import datetime as dt

import pytest

from hascheduler.dispatch import next_due
from hascheduler.fires import backoff_s, plan_catchup
from hascheduler.lease import LeaseSettingsError, LeaseTimings
from hascheduler.mirror import Entry
from hascheduler.triggers import Interval
from hascheduler.worker import FireFilter

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
EVERY_MINUTE = Interval(60.0, T0)


def at(minutes: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


@pytest.mark.parametrize(("policy", "window_s", "fired", "skipped"), [
    ("all", 3600, [1, 2, 3, 4, 5], []),
    ("all", 150, [3, 4, 5], [1, 2]),
    ("latest", 3600, [5], [1, 2, 3, 4]),
    ("none", 3600, [], [1, 2, 3, 4, 5]),
])
def test_catchup_policies(policy: str, window_s: float, fired: list[int],
                          skipped: list[int]) -> None:
    fire, skip = plan_catchup(EVERY_MINUTE, policy, window_s, at(0.5), at(5.5))
    assert fire == [at(m) for m in fired]
    assert [n for n, _ in skip] == [at(m) for m in skipped]
    assert all(reason for _, reason in skip), "every skipped fire has its reason"


def test_catchup_with_nothing_missed_is_empty() -> None:
    assert plan_catchup(EVERY_MINUTE, "all", 3600, at(5.1), at(5.9)) == ([], [])


def test_backoff_is_full_jitter_capped_exponential() -> None:
    assert backoff_s(1, 0.5, 30, 1.0) == 1.0
    assert backoff_s(3, 0.5, 30, 1.0) == 4.0
    assert backoff_s(20, 0.5, 30, 1.0) == 30.0
    assert backoff_s(3, 0.5, 30, 0.25) == 1.0
    assert backoff_s(3, 0.5, 30, 0.0) == 0.0


def test_next_due_applies_deterministic_jitter_and_keeps_the_nominal() -> None:
    entry = Entry(1, False, EVERY_MINUTE, 30.0, "all", 3600.0, "t")
    due = next_due("s", entry, at(1.6))
    assert due is not None
    assert due.nominal == at(2)
    assert at(2) <= due.fire_at < at(2) + dt.timedelta(seconds=30)
    assert next_due("s", entry, at(1.6)) == due
    # A nominal already passed whose jittered time has not: still due.
    late = next_due("s", entry, due.fire_at - dt.timedelta(milliseconds=1))
    assert late == due


@pytest.mark.parametrize(("ttl", "deadline", "interval"), [
    (10, 10, 2), (10, 7, 6), (5, 7, 2), (10, 7, 0)])
def test_lease_timings_that_cannot_fence_are_refused(ttl: float, deadline: float,
                                                      interval: float) -> None:
    with pytest.raises(LeaseSettingsError):
        LeaseTimings(ttl, deadline, interval)


def event(fire_id: str, term: int, nominal: dt.datetime) -> dict[str, object]:
    return {"id": fire_id, "data": {"term": term,
                                    "nominal_at": nominal.isoformat().replace("+00:00", "Z")}}


def test_worker_drops_repeats_and_fires_a_deposed_leader_made_after_the_new_term() -> None:
    f = FireFilter()
    assert f.verdict(event("a", 1, at(1)), at(1)) == "run"
    f.done(event("a", 1, at(1)))
    assert f.verdict(event("a", 2, at(1)), at(1.1)) == "duplicate"
    assert f.verdict(event("b", 2, at(2)), at(2)) == "run"  # term 2 first seen at 2:00
    f.done(event("b", 2, at(2)))
    # Claimed by term 1 in time (nominal before term 2 appeared), delivered late: run it.
    assert f.verdict(event("c", 1, at(1.5)), at(3)) == "run"
    # A term-1 fire for a time after term 2 was acting: a deposed leader's, dropped.
    assert f.verdict(event("d", 1, at(4)), at(4)) == "stale"
    # A handler that failed leaves the fire unseen, so the redelivery runs.
    assert f.verdict(event("e", 2, at(5)), at(5)) == "run"
    assert f.verdict(event("e", 2, at(5)), at(5.1)) == "run"
