"""The lease-history checker (pure), table by table, and its recorder over a real stream."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from hascheduler.core.lease_history import Act, TermRecord, check
from hascheduler.storage.lease import Lease, LeaseTimings
from hascheduler.storage.lease_history import LeaseHistory
from tests.waiting import wait_until

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
DEADLINE, TTL = 7.0, 10.0


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def term(n: int, acquired: float, renewed: float, released: float | None = None) -> TermRecord:
    return TermRecord(
        n, f"r{n}", at(acquired), at(renewed), at(released) if released is not None else None
    )


@pytest.mark.parametrize(
    ("terms", "acts", "violations"),
    [
        # A failover after expiry: term 2 acquired 10 s (ttl) after term 1's last renewal.
        ([term(1, 0, 20), term(2, 30, 40)], [Act(1, at(26.9), "a"), Act(2, at(30), "b")], 0),
        # A handover: term 1 released at 21, term 2 acquired at once.
        ([term(1, 0, 20, released=21), term(2, 21, 25)], [Act(1, at(20.9), "a")], 0),
        # Term 2 acquired while term 1 could still act (its deadline not passed).
        ([term(1, 0, 20), term(2, 25, 30)], [], 1),
        # An act of term 1 after its renew deadline, before the lease could pass: a write
        # sent in time and applied late (the margin is for it): a late landing.
        ([term(1, 0, 20), term(2, 30, 40)], [Act(1, at(27.5), "late")], 0),
        # ... after the lease could pass to another replica: a deposed leader acted.
        ([term(1, 0, 20), term(2, 30, 40)], [Act(1, at(30.5), "stale")], 1),
        # ... after the next term's acquisition (a handover released it early).
        ([term(1, 0, 20, released=21), term(2, 21.5, 40)], [Act(1, at(21.6), "stale")], 1),
        # An act after its term's release.
        ([term(1, 0, 20, released=21)], [Act(1, at(21.5), "late")], 1),
        # An act before its term was acquired.
        ([term(1, 0, 20), term(2, 30, 40)], [Act(2, at(29), "early")], 1),
        # An act of a term nobody acquired.
        ([term(1, 0, 20)], [Act(5, at(10), "forged")], 1),
        # An act of a term acquired before the recording began cannot be judged.
        ([term(3, 0, 20)], [Act(2, at(1), "old")], 0),
    ],
)
def test_the_checker_finds_exactly_the_violations(
    terms: list[TermRecord], acts: list[Act], violations: int
) -> None:
    report = check(terms, acts, DEADLINE, TTL)
    assert len(report.violations) + len(report.stale) == violations, report.as_dict()
    assert report.ok == (violations == 0)


def test_a_late_landing_is_counted_with_how_late_it_was() -> None:
    report = check([term(1, 0, 20), term(2, 30, 40)], [Act(1, at(28.25), "late")], DEADLINE, TTL)
    assert report.ok
    assert report.late_landings == 1
    assert report.latest_landing_s == pytest.approx(1.25)


async def test_the_recorder_sees_acquisitions_renewals_releases_and_claims(db: Any) -> None:
    timings = LeaseTimings(ttl=2.0, renew_deadline=1.4, renew_interval=0.4)
    a = Lease(db.leases, "scheduler", "a", timings)
    b = Lease(db.leases, "scheduler", "b", timings)
    async with LeaseHistory(db) as history:
        assert await a.acquire_or_renew() is not None
        await db.fires.insert_one({"_id": "s@1", "term": a.term, "state": "claimed"})
        assert await a.acquire_or_renew() is not None  # a renewal
        await a.release(None)
        view = await b.acquire_or_renew()
        assert view is not None
        await db.fires.update_one({"_id": "s@1"}, {"$set": {"term": view.term}})  # adopted
        await db.fires.insert_one({"_id": "s@2", "state": "published"})  # no term: no act
    report = history.check(timings)
    assert report.ok, report.as_dict()
    assert (report.terms, report.renewals, report.acts) == (2, 1, 2)
    records = sorted(history.terms.values(), key=lambda t: t.term)
    assert records[0].holder == "a"
    assert records[0].released_at is not None
    assert records[1].holder == "b"


async def test_the_recorder_catches_a_deposed_leaders_late_claim(db: Any) -> None:
    timings = LeaseTimings(ttl=0.6, renew_deadline=0.4, renew_interval=0.1)
    a = Lease(db.leases, "scheduler", "a", timings)
    async with LeaseHistory(db) as history:
        assert await a.acquire_or_renew() is not None
        stale = a.term
        assert stale is not None
        await wait_until(lambda: not a.valid, 5, "a's renew deadline to pass")
        await wait_until(
            lambda: (
                dt.datetime.now(dt.UTC)
                > history.terms[stale].valid_until(timings.ttl) + dt.timedelta(milliseconds=50)
            ),
            5,
            "its lease to expire",
        )
        # A claim written once the lease could have passed to another replica.
        await db.fires.insert_one({"_id": "s@late", "term": stale, "state": "claimed"})
    report = history.check(timings)
    assert not report.ok
    assert [a.what for a in report.stale] == ["s@late"]
