"""The lease against a real server: compare-and-swap on its clock, terms, release."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from pymongo import AsyncMongoClient

from hascheduler.replica.leadership import Elector
from hascheduler.storage.collection import Collection
from hascheduler.storage.lease import Lease, LeaseSettingsError, LeaseTimings
from tests.waiting import wait_until

FAST = LeaseTimings(ttl=1.0, renew_deadline=0.7, renew_interval=0.2)


@pytest.fixture
async def leases(mongo_uri: str, db_name: str) -> AsyncIterator[Any]:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri, tz_aware=True)
    yield client[db_name].leases
    await client.drop_database(db_name)
    await client.close()


async def test_one_holder_terms_bump_only_on_change(leases: Any) -> None:
    a, b = Lease(leases, "L", "a", FAST), Lease(leases, "L", "b", FAST)
    first = await a.acquire_or_renew()
    assert first is not None
    assert (first.holder, first.term) == ("a", 1)
    assert a.valid
    assert await b.acquire_or_renew() is None  # held: losing is a normal answer
    renewed = await a.acquire_or_renew()
    assert renewed is not None
    assert renewed.term == 1  # a renewal keeps the term
    assert await a.release(None)
    taken = await b.acquire_or_renew()
    assert taken is not None
    assert (taken.holder, taken.term) == ("b", 2)


async def test_expiry_lets_another_in_and_the_old_holder_stops_first(leases: Any) -> None:
    a, b = Lease(leases, "L", "a", FAST), Lease(leases, "L", "b", FAST)
    assert await a.acquire_or_renew() is not None

    await wait_until(b.acquire_or_renew, 5, "b to acquire the expired lease")
    # a stopped acting before its lease could expire for b: the deadline is shorter.
    assert not a.valid
    assert b.term == 2
    assert await a.acquire_or_renew() is None


async def test_watermark_is_recorded_only_by_the_holder(leases: Any) -> None:
    import datetime as dt

    mark = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    a, b = Lease(leases, "L", "a", FAST), Lease(leases, "L", "b", FAST)
    await a.acquire_or_renew()
    view = await a.acquire_or_renew(fired_through=mark)
    assert view is not None
    assert view.fired_through == mark
    assert await b.acquire_or_renew(fired_through=mark.replace(year=2031)) is None
    stored = await a.read()
    assert stored is not None
    assert stored.fired_through == mark


class IdleDispatcher:
    """Stands in for the firing engine: records that it was asked to lead, then waits."""

    fired_through = None

    def __init__(self) -> None:
        self.leading = False

    async def lead(self, view: Any) -> None:
        self.leading = True
        try:
            await asyncio.Event().wait()
        finally:
            self.leading = False

    def hand_over(self) -> None:
        pass

    async def drain(self) -> bool:
        return True

    async def settle(self, timeout_s: float) -> bool:
        return True


async def test_an_unready_replica_never_leads_and_hands_over_when_out_of_sync(leases: Any) -> None:
    ready = False
    dispatcher = IdleDispatcher()
    elector = Elector(
        Lease(leases, "L", "a", FAST),
        dispatcher,
        leases,
        unfit=lambda: None if ready else "the mirror is not in sync",
    )
    runner = asyncio.create_task(elector.run())
    try:
        # Five turns of the elector with a free lease: an unready replica must not take it.
        async def five_turns_unclaimed() -> bool:
            assert await leases.find_one({"_id": "L"}) is None
            assert not dispatcher.leading
            return elector.attempts >= 5

        await wait_until(five_turns_unclaimed, 10, "five election turns")

        async def leading() -> bool:
            return dispatcher.leading

        async def stopped() -> bool:
            return not dispatcher.leading

        ready = True
        await wait_until(leading, 5, "the ready replica to lead")
        assert (await leases.find_one({"_id": "L"}))["holder"] == "a"
        ready = False  # the mirror fell out of sync while leading
        await wait_until(stopped, 5, "the leader to stop firing")
        assert not elector.is_leader

        # It released the lease instead of letting it run out (the release follows the
        # stop by a round trip: waited for, not assumed): another gets it at once.
        async def released() -> bool:
            doc = await leases.find_one({"_id": "L"})
            return doc is not None and "released_at" in doc

        await wait_until(released, 5, "the lease released")
        assert await Lease(leases, "L", "b", FAST).acquire_or_renew() is not None
    finally:
        elector.stop()
        await asyncio.wait_for(runner, 5)


class SlowLeases:
    """The lease collection behind a link whose renewals take ``delay_s`` each."""

    def __init__(self, leases: Any, delay_s: float) -> None:
        self._leases, self.delay_s = leases, delay_s
        self.sent: list[float] = []

    async def find_one(self, *args: Any, **kwargs: Any) -> Any:
        return await self._leases.find_one(*args, **kwargs)

    async def find_one_and_update(self, *args: Any, **kwargs: Any) -> Any:
        self.sent.append(asyncio.get_running_loop().time())
        await asyncio.sleep(self.delay_s)  # the slow link's latency, the condition under test
        return await self._leases.find_one_and_update(*args, **kwargs)

    async def update_one(self, *args: Any, **kwargs: Any) -> Any:
        return await self._leases.update_one(*args, **kwargs)


async def test_renewals_keep_their_cadence_over_a_slow_link(leases: Any) -> None:
    # Renewals taking 0.25 s against a 0.2 s interval and a 0.7 s deadline: sent a renew
    # interval after the previous answer, each would leave the next 0.25 s (0.7 - 0.2 -
    # 0.25) and the lease would lapse at once; sent a renew interval after the previous
    # send (or at its answer, whichever is later), each has 0.45 s.
    slow = SlowLeases(leases, delay_s=0.25)
    dispatcher = IdleDispatcher()
    elector = Elector(
        Lease(cast(Collection, slow), "L", "a", FAST),  # the calls a lease makes
        dispatcher,
        leases,
    )
    runner = asyncio.create_task(elector.run())
    try:

        async def leading() -> bool:
            return dispatcher.leading

        await wait_until(leading, 5, "a to lead")
        first = elector.attempts

        async def twelve_renewals() -> bool:
            assert dispatcher.leading, "the leader lost its lease over the slow link"
            assert elector.lease.term == 1
            return elector.attempts >= first + 12

        await wait_until(twelve_renewals, 10, "twelve renewals over the slow link")
        gaps = [b - a for a, b in zip(slow.sent[-12:], slow.sent[-11:], strict=False)]
        assert max(gaps) < 0.25 + 0.1, gaps  # back to back, not 0.25 + 0.2 apart
    finally:
        elector.stop()
        await asyncio.wait_for(runner, 5)


@pytest.mark.parametrize(
    ("ttl", "deadline", "interval"), [(10, 10, 2), (10, 7, 6), (5, 7, 2), (10, 7, 0)]
)
def test_lease_timings_that_cannot_fence_are_refused(
    ttl: float, deadline: float, interval: float
) -> None:
    with pytest.raises(LeaseSettingsError):
        LeaseTimings(ttl, deadline, interval)
