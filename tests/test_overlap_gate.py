"""The leader's overlap gate against the development server: what the database shows
between a waiting fire's release and its run's reservation must not let a later fire pass
it."""

from __future__ import annotations

import datetime as dt
import unittest.mock
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from pymongo import AsyncMongoClient

from hascheduler.core.claims import Claim
from hascheduler.core.entries import Entry, compile_trigger
from hascheduler.core.triggers import fire_id
from hascheduler.process.metrics import Metrics
from hascheduler.replica import overlap
from hascheduler.replica.overlap import OverlapGate
from hascheduler.replica.term import LeadershipLost, Term
from hascheduler.storage.collection import Collection
from hascheduler.storage.fire_records import BUFFERED, claim_document
from hascheduler.storage.fires import Ledger
from hascheduler.storage.lease import Lease, LeaseTimings
from hascheduler.storage.reservations import open_key
from hascheduler.storage.runs import RunLedger
from tests.servers import with_database

TERM = 1


@pytest.fixture
async def db(mongo_uri: str) -> AsyncIterator[Any]:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        with_database(mongo_uri, f"gate_{uuid.uuid4().hex[:8]}"), tz_aware=True
    )
    database = client.get_default_database()
    yield database
    await client.drop_database(database)
    await client.close()


@pytest.fixture
async def gate(db: Any) -> OverlapGate:
    ledger, runs = Ledger(db.fires), RunLedger(db.runs)
    await ledger.ensure_indexes(3600)
    await runs.ensure_indexes(3600)
    return OverlapGate(
        ledger,
        runs,
        {"s": every_minute("buffer_all")},
        10,
        lambda: dt.datetime.now(dt.UTC),
        Metrics(),
    )


def every_minute(overlap: str) -> Entry:
    """Schedule "s", every minute, under ``overlap``."""
    return Entry(
        1,
        False,
        compile_trigger({"kind": "cron", "cron": "* * * * *"}),
        0.0,
        "none",
        0.0,
        "jobs.s",
        overlap=overlap,
    )


@pytest.fixture
async def term(db: Any) -> Term:
    """Term TERM of a real lease, held: the gate's reads and writes are fenced by it."""
    lease = Lease(db.leases, "scheduler", "a", LeaseTimings())
    view = await lease.acquire_or_renew()
    assert view is not None
    assert view.term == TERM
    return await Term(TERM, lease, {}).__aenter__()


async def claimed(gate: OverlapGate, n: int, now: dt.datetime) -> Claim:
    nominal = now + dt.timedelta(seconds=n)
    await gate.ledger.claim([claim_document("s", nominal, nominal, TERM, now)])
    return Claim(fire_id("s", nominal), "s", nominal, nominal)


async def test_a_fire_arriving_while_a_waiting_one_is_released_waits_behind_it(
    gate: OverlapGate, term: Term
) -> None:
    now = dt.datetime.now(dt.UTC)
    first, second, third = [await claimed(gate, n, now) for n in (1, 2, 3)]
    targets = {"s": "jobs.s"}
    assert await gate.admit([first], targets, term) == [first]
    assert await gate.admit([second], targets, term) == []  # waits for the first's run
    await gate.runs.unreserve(first.fire_id, TERM)  # the first's run ends

    released = await gate.ready(term, now + dt.timedelta(minutes=1))
    assert [c.fire_id for c in released] == [second.fire_id]
    # Between the release and the reservation of its run the database shows neither a
    # buffered fire nor an open run for the key: the third fire must still wait.
    assert await gate.admit([third], targets, term) == []
    doc = await gate.ledger.fires.find_one({"_id": third.fire_id})
    assert doc is not None
    assert doc["state"] == BUFFERED

    assert [c.fire_id for c in await gate.admit(released, targets, term, released=True)] == [
        second.fire_id
    ]
    gate.released(released)
    assert await gate.runs.open_runs([open_key("s", None)]) == {open_key("s", None): second.fire_id}
    # Once the second's run ends, the third goes, in order.
    await gate.runs.unreserve(second.fire_id, TERM)
    assert [c.fire_id for c in await gate.ready(term, now + dt.timedelta(minutes=1))] == [
        third.fire_id
    ]


async def test_a_buffered_fire_of_a_paused_schedule_waits_for_the_resume(
    gate: OverlapGate, term: Term
) -> None:
    """The open run ends while the schedule is paused: its buffered fire is not released
    (on 19ca195 it was published 2.8 s into the pause); resumed, it goes."""
    now = dt.datetime.now(dt.UTC)
    first, second = [await claimed(gate, n, now) for n in (1, 2)]
    targets = {"s": "jobs.s"}
    assert await gate.admit([first], targets, term) == [first]
    assert await gate.admit([second], targets, term) == []  # buffered behind the first
    entries: dict[str, Entry] = gate.entries  # type: ignore[assignment]
    running = entries["s"]
    entries["s"] = running.replace(revision=2, paused=True)
    await gate.runs.unreserve(first.fire_id, TERM)  # the first's run ends during the pause
    assert await gate.ready(term, now + dt.timedelta(minutes=1)) == []
    doc = await gate.ledger.fires.find_one({"_id": second.fire_id})
    assert doc is not None
    assert doc["state"] == BUFFERED
    # Paused until an instant now passed: as good as resumed.
    entries["s"] = running.replace(
        revision=3, paused=True, paused_until=now - dt.timedelta(seconds=1)
    )
    assert [c.fire_id for c in await gate.ready(term, now + dt.timedelta(minutes=1))] == [
        second.fire_id
    ]


async def test_a_fire_that_holds_its_keys_run_itself_goes_though_fires_wait_behind_it(
    gate: OverlapGate, term: Term
) -> None:
    """Fire 1 reserved its key's run and its publish failed (the broker down, or its
    leader deposed); fire 2 was buffered behind that run. Fire 1 retried (or adopted by the
    next leader) comes through the gate again: it holds the open run itself, so it goes.
    On 19ca195 it was buffered or skipped behind fire 2, its reservation held the key, and
    fire 2 waited for ever (the chaos soak: a buffer_one schedule's fire never published)."""
    now = dt.datetime.now(dt.UTC)
    first, second = [await claimed(gate, n, now) for n in (1, 2)]
    targets = {"s": "jobs.s"}
    assert await gate.admit([first], targets, term) == [first]
    assert await gate.admit([second], targets, term) == []  # waits for the first's run
    assert await gate.admit([first], targets, term) == [first]  # the retry goes
    doc = await gate.ledger.fires.find_one({"_id": first.fire_id})
    assert doc is not None
    assert doc["state"] == "claimed"
    assert await gate.runs.open_runs([open_key("s", None)]) == {open_key("s", None): first.fire_id}
    # Its run ended and the second went; then the first, its mark lost, is retried: it
    # was let through before (its run exists), so it goes again (the broker drops the
    # copy), never recorded skipped behind the one buffered since.
    third = await claimed(gate, 3, now)
    await gate.runs.unreserve(first.fire_id, TERM)
    released = await gate.ready(term, now + dt.timedelta(minutes=1))
    assert [c.fire_id for c in released] == [second.fire_id]
    assert [c.fire_id for c in await gate.admit(released, targets, term, released=True)] == [
        second.fire_id
    ]
    gate.released(released)
    # The second's run ends (its worker is done); the third opens the key, a fourth
    # waits behind it.
    await gate.runs.runs.update_one(
        {"_id": second.fire_id}, {"$set": {"state": "succeeded"}, "$unset": {"open_key": ""}}
    )
    fourth = await claimed(gate, 4, now)
    assert await gate.admit([third], targets, term) == [third]
    assert await gate.admit([fourth], targets, term) == []
    assert await gate.admit([second], targets, term) == [second]  # its mark lost: again
    doc = await gate.ledger.fires.find_one({"_id": second.fire_id})
    assert doc is not None
    assert doc["state"] == "claimed"
    # Retried in one batch with an earlier fire of its key (a term's retries, adopted
    # claims), nothing waiting: the one that holds the run goes, the other waits behind.
    await gate.runs.unreserve(third.fire_id, TERM)
    await gate.runs.runs.delete_many({"_id": {"$in": [fourth.fire_id, second.fire_id]}})
    gate.waiting.clear()
    await gate.ledger.fires.update_many({"state": "buffered"}, {"$set": {"state": "claimed"}})
    assert await gate.admit([fourth], targets, term) == [fourth]  # reserves the key
    assert await gate.admit([third, fourth], targets, term) == [fourth]


async def test_a_fire_whose_run_ended_goes_again_alone_though_another_run_is_open(
    gate: OverlapGate, term: Term
) -> None:
    """Fire 1 was published and its run has ended; fire 2's run is open; fire 1, its mark
    lost, is retried alone with nothing waiting: its run's insert is refused on the key
    (the server may check that index before the id's), yet it was let through before, so
    it goes. On 19ca195 it was recorded skipped, though in the stream (the chaos soak)."""
    now = dt.datetime.now(dt.UTC)
    first, second = [await claimed(gate, n, now) for n in (1, 2)]
    targets = {"s": "jobs.s"}
    assert await gate.admit([first], targets, term) == [first]
    await gate.runs.runs.update_one(
        {"_id": first.fire_id}, {"$set": {"state": "succeeded"}, "$unset": {"open_key": ""}}
    )
    assert await gate.admit([second], targets, term) == [second]
    assert await gate.admit([first], targets, term) == [first]
    doc = await gate.ledger.fires.find_one({"_id": first.fire_id})
    assert doc is not None
    assert doc["state"] == "claimed"


async def test_a_fire_arriving_while_the_release_takes_the_waiting_one_waits_behind_it(
    gate: OverlapGate, term: Term
) -> None:
    """The window inside the take itself: the waiting fire is already claimed (no longer
    buffered) and its run not yet reserved when the next fire is admitted."""
    now = dt.datetime.now(dt.UTC)
    first, second, third = [await claimed(gate, n, now) for n in (1, 2, 3)]
    targets = {"s": "jobs.s"}
    assert await gate.admit([first], targets, term) == [first]
    assert await gate.admit([second], targets, term) == []
    await gate.runs.unreserve(first.fire_id, TERM)

    admitted_during_take: list[list[Claim]] = []
    take = gate.ledger.take

    async def take_then_admit(*args: Any, **kwargs: Any) -> None:
        await take(*args, **kwargs)
        admitted_during_take.append(await gate.admit([third], targets, term))

    gate.ledger.take = take_then_admit  # type: ignore[method-assign]
    released = await gate.ready(term, now + dt.timedelta(minutes=1))
    assert [c.fire_id for c in released] == [second.fire_id]
    assert admitted_during_take == [[]]  # the third waits behind the second


class CountedWrites:
    """A fires collection that counts the leader's update commands."""

    def __init__(self, fires: Any) -> None:
        self.fires = fires
        self.updates = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fires, name)

    async def update_many(self, *args: Any, **kwargs: Any) -> Any:
        self.updates += 1
        return await self.fires.update_many(*args, **kwargs)

    async def bulk_write(self, *args: Any, **kwargs: Any) -> Any:
        self.updates += 1
        return await self.fires.bulk_write(*args, **kwargs)


async def test_fires_held_back_by_many_open_runs_each_name_their_own_in_one_write(
    gate: OverlapGate, term: Term
) -> None:
    """A busy second refuses fires of thousands of schedules, each for its own open run:
    their records are one write for the skipped and one for the buffered, not one each."""
    now = dt.datetime.now(dt.UTC)
    trigger = compile_trigger({"kind": "cron", "cron": "* * * * *"})
    ids = [f"skip{i}" for i in range(20)] + [f"buffer{i}" for i in range(20)]
    gate.entries = {
        s: Entry(
            1,
            False,
            trigger,
            0.0,
            "none",
            0.0,
            "jobs.s",
            overlap="skip" if s.startswith("skip") else "buffer_one",
        )
        for s in ids
    }
    targets = dict.fromkeys(ids, "jobs.s")

    async def fires_at(n: int) -> list[Claim]:
        nominal = now + dt.timedelta(seconds=n)
        await gate.ledger.claim([claim_document(s, nominal, nominal, TERM, now) for s in ids])
        return [Claim(fire_id(s, nominal), s, nominal, nominal) for s in ids]

    first = await fires_at(1)
    assert await gate.admit(first, targets, term) == first  # each opens its schedule's run
    counted = CountedWrites(gate.ledger.fires)
    gate.ledger.fires = cast(Collection, counted)  # the collection, its updates counted
    assert await gate.admit(await fires_at(2), targets, term) == []
    assert counted.updates == 2
    opened = {c.schedule_id: c.fire_id for c in first}
    held_back = [d async for d in counted.fires.find({"nominal_at": now + dt.timedelta(seconds=2)})]
    assert len(held_back) == len(ids)
    for doc in held_back:
        assert doc["open_run"] == opened[doc["schedule_id"]]
        assert doc["state"] == ("skipped" if doc["schedule_id"].startswith("skip") else BUFFERED)
        if doc["state"] == "skipped":
            assert doc["reason"] == "overlap"


async def test_a_fire_whose_run_is_open_ahead_of_its_due_time_is_asked_again_at_it(
    gate: OverlapGate, term: Term
) -> None:
    """Ahead of the due time an open run holds the fire back, recording nothing; at the
    due time it goes if that run has ended, and only a run still open then skips it."""
    now = dt.datetime.now(dt.UTC)
    first, second, third = [await claimed(gate, n, now) for n in (1, 2, 3)]
    for claim in (first, second, third):
        claim.overlap = "skip"
    targets = {"s": "jobs.s"}
    assert await gate.admit_ahead([first], targets, term) == ([first], [])
    with unittest.mock.patch.object(
        gate.runs,
        "open_runs",
        side_effect=AssertionError("a held fire records nothing: its blocker is not looked up"),
    ):
        assert await gate.admit_ahead([second], targets, term) == ([], [second])
    doc = await gate.ledger.fires.find_one({"_id": second.fire_id})
    assert doc is not None
    assert doc["state"] == "claimed"  # nothing decided yet
    await gate.runs.unreserve(first.fire_id, TERM)  # the first's run ends before the due time
    assert await gate.admit([second], targets, term) == [second]
    assert await gate.runs.open_runs([open_key("s", None)]) == {open_key("s", None): second.fire_id}

    assert await gate.admit_ahead([third], targets, term) == ([], [third])
    assert await gate.admit([third], targets, term) == []  # still open at its due time
    doc = await gate.ledger.fires.find_one({"_id": third.fire_id})
    assert doc is not None
    assert (doc["state"], doc["reason"], doc["open_run"]) == ("skipped", "overlap", second.fire_id)


async def next_term(db: Any, gate: OverlapGate, term: Term) -> tuple[OverlapGate, Term]:
    """Term ``term`` is deposed (its lease released) and another replica's term begins,
    with its own gate over the same database."""
    await term._lease.release(None)  # type: ignore[attr-defined]
    lease = Lease(db.leases, "scheduler", "b", LeaseTimings())
    view = await lease.acquire_or_renew()
    assert view is not None
    assert view.term == TERM + 1
    successor = OverlapGate(
        Ledger(db.fires), RunLedger(db.runs), gate.entries, 10, gate.clock, Metrics()
    )
    await successor.begin()
    return successor, await Term(TERM + 1, lease, {}).__aenter__()


async def test_a_reservation_landing_after_its_term_was_deposed_holds_nothing_and_goes_nowhere(
    db: Any, gate: OverlapGate, term: Term
) -> None:
    """Term 1 reserves fire 2's run; before the write lands, term 1 is deposed, term 2
    adopts fire 2 and records it skipped behind fire 1's open run, and fire 1's run ends;
    then term 1's reservation lands (the key is free by then). Term 1 publishes nothing
    and withdraws it: on 8dea6d2 it published fire 2 (recorded skipped, yet run: the chaos
    soak's buffer_one schedules), or, deposed before its publish, left the reservation
    pending to hold the key for ever."""
    now = dt.datetime.now(dt.UTC)
    first, second = [await claimed(gate, n, now) for n in (1, 2)]
    for claim in (first, second):
        claim.overlap = "skip"
    targets = {"s": "jobs.s"}
    assert await gate.admit([first], targets, term) == [first]
    reserve = gate.runs.reserve

    async def deposed_meanwhile(*args: Any, **kwargs: Any) -> dict[str, str]:
        successor, later = await next_term(db, gate, term)
        await gate.ledger.fires.update_one(
            {"_id": second.fire_id}, {"$set": {"term": later.number}}
        )
        assert await successor.admit([second], targets, later) == []  # fire 1's run is open
        await gate.runs.runs.update_one(
            {"_id": first.fire_id}, {"$set": {"state": "succeeded"}, "$unset": {"open_key": ""}}
        )
        return await reserve(*args, **kwargs)  # lands now, on a free key

    gate.runs.reserve = deposed_meanwhile  # type: ignore[method-assign]
    with pytest.raises(LeadershipLost):
        await gate.admit([second], targets, term)
    assert await gate.runs.with_runs([second.fire_id]) == set()
    assert await gate.runs.open_runs([open_key("s", None)]) == {}
    doc = await gate.ledger.fires.find_one({"_id": second.fire_id})
    assert doc is not None
    assert (doc["state"], doc["reason"], doc["term"]) == ("skipped", "overlap", TERM + 1)


async def test_a_reservation_a_newer_term_went_on_with_stays_when_the_deposed_one_withdraws(
    db: Any, gate: OverlapGate, term: Term
) -> None:
    """Term 1 reserved fire 1's run and was deposed before publishing it; term 2 adopts the
    fire and goes on its run (the fire's own). Term 1's withdrawal, late, leaves that run
    to term 2: the key stays held by it until its worker ends it."""
    now = dt.datetime.now(dt.UTC)
    first = await claimed(gate, 1, now)
    first.overlap = "skip"
    targets = {"s": "jobs.s"}
    assert await gate.admit([first], targets, term) == [first]
    successor, later = await next_term(db, gate, term)
    await gate.ledger.fires.update_one({"_id": first.fire_id}, {"$set": {"term": later.number}})
    assert await successor.admit([first], targets, later) == [first]
    await gate.runs.withdraw([first.fire_id], TERM)
    await gate.runs.unreserve(first.fire_id, TERM)
    assert await gate.runs.open_runs([open_key("s", None)]) == {open_key("s", None): first.fire_id}
    run = await gate.runs.get(first.fire_id)
    assert run is not None
    assert (run["state"], run["term"]) == ("pending", TERM + 1)


async def test_a_reservation_left_by_a_term_killed_before_withdrawing_it_is_withdrawn(
    gate: OverlapGate, term: Term, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fire 2 waits behind fire 1's run, reserved by a term killed before it could
    withdraw it; fire 1 is then recorded skipped (the reservation had landed after the
    decision). The leader finds it stale and releases fire 2: on 8dea6d2 fire 2 waited for
    good (the chaos soak's buffer_one schedules)."""
    monkeypatch.setattr(overlap, "STALE_CHECK_S", 0.0)  # every look looks
    now = dt.datetime.now(dt.UTC)
    first, second = [await claimed(gate, n, now) for n in (1, 2)]
    targets = {"s": "jobs.s"}
    await gate.runs.reserve([first], targets, now, TERM - 1)  # the killed term's
    assert await gate.admit([second], targets, term) == []  # fire 1 not decided yet
    await gate.ledger.fires.update_one(
        {"_id": first.fire_id}, {"$set": {"state": "skipped", "reason": "overlap"}}
    )
    doc = await gate.ledger.fires.find_one({"_id": second.fire_id})
    assert doc is not None
    assert (doc["state"], doc["open_run"]) == (BUFFERED, first.fire_id)
    released = await gate.ready(term, now + dt.timedelta(minutes=1))
    assert [c.fire_id for c in released] == [second.fire_id]
    assert await gate.runs.with_runs([first.fire_id]) == set()
    assert [c.fire_id for c in await gate.admit(released, targets, term, released=True)] == [
        second.fire_id
    ]


async def test_nothing_is_buffered_ahead_of_its_due_time(gate: OverlapGate, term: Term) -> None:
    """Two fires of one key admitted ahead together (a loop late by a stall takes the next
    second's with this one's): the first reserves the run, the second is held, nothing
    recorded, to be asked at its due time. On 8dea6d2 it was buffered ahead; the first's
    run ended at once, and the release published it before it was due (the chaos soak,
    seed 2: three buffer_one schedules early at one instant)."""
    now = dt.datetime.now(dt.UTC)
    first, second = [await claimed(gate, n, now) for n in (1, 2)]
    for claim in (first, second):
        claim.overlap = "buffer_one"
    targets = {"s": "jobs.s"}
    assert await gate.admit_ahead([first, second], targets, term) == ([first], [second])
    doc = await gate.ledger.fires.find_one({"_id": second.fire_id})
    assert doc is not None
    assert doc["state"] == "claimed"  # not buffered: the release cannot take it early
    assert gate.waiting == set()
    await gate.runs.unreserve(first.fire_id, TERM)  # the first's run ends at once
    assert await gate.ready(term, now + dt.timedelta(minutes=1)) == []


async def test_a_stale_reservation_is_withdrawn_when_it_refuses_a_fire_at_its_due_time(
    gate: OverlapGate, term: Term
) -> None:
    """Under `skip` nothing waits behind a run: a reservation left by a killed term, its
    fire recorded skipped, refused every later fire of its key, each recorded skipped for
    good. Found when it refuses one, it is withdrawn and the fire decided again: it goes."""
    now = dt.datetime.now(dt.UTC)
    first, second = [await claimed(gate, n, now) for n in (1, 2)]
    for claim in (first, second):
        claim.overlap = "skip"
    targets = {"s": "jobs.s"}
    await gate.runs.reserve([first], targets, now, TERM - 1)  # the killed term's
    await gate.ledger.skip([first.fire_id], TERM, "overlap")
    assert await gate.admit([second], targets, term) == [second]
    assert await gate.runs.open_runs([open_key("s", None)]) == {open_key("s", None): second.fire_id}


async def test_a_fire_refused_by_a_run_that_ends_before_it_is_named_is_decided_again(
    gate: OverlapGate, term: Term, db: Any
) -> None:
    """A `skip` fire refused by its key's open run, which ends between the refusal and the
    read that names it: the key is free, and the fire is decided again and goes. Before, it
    was recorded skipped naming no run (`open_run: ""`)."""
    now = dt.datetime.now(dt.UTC)
    gate.entries = {"s": every_minute("skip")}
    targets = {"s": "jobs.s"}
    first = await claimed(gate, 1, now)
    assert await gate.admit([first], targets, term) == [first]

    class EndedWhileNamed(RunLedger):
        async def open_runs(self, keys: list[str]) -> dict[str, str]:
            # The open run ends as the read is sent: the read finds none.
            await db.runs.update_one(
                {"_id": first.fire_id}, {"$set": {"state": "succeeded"}, "$unset": {"open_key": ""}}
            )
            return await super().open_runs(keys)

    gate.runs = EndedWhileNamed(db.runs)
    second = await claimed(gate, 2, now)
    assert await gate.admit([second], targets, term) == [second]
    assert (await db.fires.find_one({"_id": second.fire_id}))["state"] != "skipped"
    assert (await db.runs.find_one({"_id": second.fire_id}))["open_key"] == "s"
