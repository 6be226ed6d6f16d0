"""Take-over (replica/takeover.py): adopting what older terms left, catching up, and the
retry loop."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from functools import partial
from typing import Any

import pytest
from pymongo.errors import AutoReconnect, ExecutionTimeout

from hascheduler.core.catchup import (
    plan_catchups,
)
from hascheduler.core.claims import Claim
from hascheduler.core.entries import Entry, Written
from hascheduler.core.events import FireMessage
from hascheduler.core.fanout import FanOut
from hascheduler.core.triggers import Interval, fire_id
from hascheduler.replica.dispatch import Dispatcher
from hascheduler.replica.firing import (
    CLAIM_BATCH,
)
from hascheduler.replica.term import LeadershipLost, Term
from hascheduler.storage.fire_records import CLAIMED, PUBLISHED, claim_document
from hascheduler.storage.fires import Ledger
from hascheduler.storage.lease import LeaseView
from hascheduler.storage.schedules import ScheduleStore
from tests.dispatching import (
    AckingBroker,
    AdoptionsNoted,
    ClaimsNoted,
    FixedLease,
    Mirrored,
    OneSchedule,
    leading,
    stores_over,
    unreachable_db,
)
from tests.waiting import wait_until


@pytest.fixture
async def fresh_db(mongo_uri: str) -> AsyncIterator[Any]:
    """A database of its own on the development server."""
    import uuid

    from pymongo import AsyncMongoClient

    from tests.servers import with_database

    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        with_database(mongo_uri, f"dispatch_{uuid.uuid4().hex[:8]}"), tz_aware=True
    )
    try:
        yield client.get_default_database()
    finally:
        await client.close()


def test_a_catch_up_fires_what_the_previous_leader_passed_before_it_learned_of_a_schedule() -> None:
    """A schedule created 4.5 s before the previous leader's watermark (``since``) whose
    write was held up, or whose change reached that leader's mirror late, and the lease
    lost before it did: the catch-up fires its instants from its creation to ``since``
    too, whatever its policy (as a late change's are, replan_from), then by its policy
    from ``since``; one the catch-up knows no creation of, from ``since``. Planned from
    ``since`` alone, the first instants were never fired (the chaos soak: five fires of a
    schedule created while its replica's database link stalled, never claimed)."""
    since = dt.datetime.now(dt.UTC).replace(microsecond=0)
    now = since + dt.timedelta(seconds=3)
    every = Interval(1.0, since - dt.timedelta(seconds=20))

    def entry(policy: str) -> Entry:
        return Entry(1, False, every, 0.0, policy, 3600.0, "t.x")

    # A fan-out's late instants are fired too, for the tenants selected at the claim.
    fan_out = Entry(
        1, False, every, 0.0, "latest", 3600.0, "t.x", fan_out=FanOut(collection="tenants")
    )
    seconds = [since + dt.timedelta(seconds=k) for k in range(-4, 4)]  # since-4 .. since+3
    fire, skipped = plan_catchups(
        [
            ("late", entry("latest")),
            ("late-none", entry("none")),
            ("known", entry("latest")),
            ("new", entry("all")),
            ("fan-out", fan_out),
        ],
        since,
        now,
        {
            "late": since - dt.timedelta(seconds=4.5),
            "late-none": since - dt.timedelta(seconds=4.5),
            "new": since + dt.timedelta(seconds=1.5),
            "fan-out": since - dt.timedelta(seconds=4.5),
        },
    )
    fired = {
        sid: sorted(d.nominal for d in fire if d.schedule_id == sid)
        for sid in ("late", "late-none", "known", "new", "fan-out")
    }
    assert fired["late"] == [*seconds[:5], seconds[-1]]  # since-4 .. since, then the latest
    assert fired["late-none"] == seconds[:5]
    assert fired["known"] == [seconds[-1]]
    assert fired["new"] == seconds[-2:]  # created after since: from its creation, as before
    assert fired["fan-out"] == [*seconds[:5], seconds[-1]]
    # A database's first term (no watermark): each from its creation, by its policy.
    first, _ = plan_catchups(
        [("late", entry("latest"))], None, now, {"late": since - dt.timedelta(seconds=4.5)}
    )
    assert [d.nominal for d in first] == [seconds[-1]]
    # The skipped ranges are those of the policies, after since only.
    assert {sid: (r.first, r.last) for sid, r in skipped} == {
        "late": (seconds[5], seconds[6]),
        "late-none": (seconds[5], seconds[7]),
        "known": (seconds[5], seconds[6]),
        "fan-out": (seconds[5], seconds[6]),
    }


class Unreadable(ScheduleStore):
    """The schedules, whose creation times cannot be read ``failures`` times."""

    def __init__(self, db: Any, failures: int, error: Exception) -> None:
        super().__init__(db.schedules)
        self.failures = failures
        self.error = error
        self.reads = 0

    async def created_after(self, after: dt.datetime) -> dict[str, dt.datetime]:
        self.reads += 1
        if self.reads <= self.failures:
            raise self.error
        return await super().created_after(after)


async def led_until_new_fired(
    db: Any,
    store: ScheduleStore,
    entries: dict[str, Entry],
    since: dt.datetime,
    dispatchers: list[Dispatcher] | None = None,
) -> list[str]:
    """Term 2 led after the watermark ``since`` over ``store`` until schedule "new" fired
    its instants 2, 3 and 4 s after it: the fire ids published (the dispatcher is added to
    ``dispatchers``, for a store that changes the mirror through it)."""
    sent: list[str] = []
    lease = FixedLease(term=2, ttl_s=1.0)
    stores = dataclasses.replace(stores_over(db), store=store)
    dispatcher = Dispatcher(Mirrored(entries), stores, AckingBroker(sent), lease)
    if dispatchers is not None:
        dispatchers.append(dispatcher)
    second = dt.timedelta(seconds=1)
    view = LeaseView("b", 2, dt.datetime.now(dt.UTC) + second, fired_through=since)
    lead = asyncio.create_task(dispatcher.lead(view))
    caught_up = {fire_id("new", since + k * second) for k in (2, 3, 4)}
    try:
        await wait_until(partial(caught_up.issubset, sent), 10, "the fires from its creation")
    finally:
        lead.cancel()
        await asyncio.gather(lead, return_exceptions=True)
    return sent


async def test_creation_times_that_cannot_be_read_hold_the_catch_up_back_until_they_are(
    fresh_db: Any,
) -> None:
    """Against the development server: a schedule created 1.5 s after the previous
    leader's watermark, whose creation time the catch-up's reads fail to get (a timeout, a
    reset link), is caught up once a read does, from its creation: never from the
    watermark, which fired the instants before its creation."""
    db = fresh_db
    second = dt.timedelta(seconds=1)
    now = dt.datetime.now(dt.UTC)
    since = now.replace(microsecond=0) - 4 * second
    created = since + 1.5 * second
    await db.schedules.insert_one(
        {"_id": "new", "target": "t.x", "payload": {}, "revision": 1, "created_at": created}
    )
    await Ledger(db.fires).ensure_indexes(3600)
    entries = {"new": Entry(1, False, Interval(1.0, since - 60 * second), 0.0, "all", 60.0, "t.x")}
    for error in (ExecutionTimeout("operation exceeded time limit"), AutoReconnect("reset")):
        await db.fires.delete_many({})
        store = Unreadable(db, 3, error)
        sent = await led_until_new_fired(db, store, entries, since)
        assert store.reads > 3
        assert fire_id("new", since + second) not in sent, sent


async def test_a_schedule_the_mirror_applies_during_the_read_is_not_caught_up_from_the_watermark(
    fresh_db: Any,
) -> None:
    """Against the development server: a schedule created 1.5 s after the previous
    leader's watermark whose change the mirror applies while the catch-up's read of
    creation times is in flight, too late for the read to see it, is planned from its
    creation by its change, never from the watermark by the catch-up."""
    db = fresh_db
    second = dt.timedelta(seconds=1)
    now = dt.datetime.now(dt.UTC)
    since = now.replace(microsecond=0) - 4 * second
    created = since + 1.5 * second
    await Ledger(db.fires).ensure_indexes(3600)
    entries: dict[str, Entry] = {}
    dispatchers: list[Dispatcher] = []

    class AppliedDuringTheRead(ScheduleStore):
        async def created_after(self, after: dt.datetime) -> dict[str, dt.datetime]:
            read = await super().created_after(after)
            if after < since:  # the catch-up's: the change lands as its answer comes
                await db.schedules.insert_one(
                    {
                        "_id": "new",
                        "target": "t.x",
                        "payload": {},
                        "revision": 1,
                        "created_at": created,
                    }
                )
                entries["new"] = Entry(
                    1, False, Interval(1.0, since - 60 * second), 0.0, "all", 60.0, "t.x"
                )
                dispatchers[0].on_change("new", entries["new"], Written(created, created))
            return read

    store = AppliedDuringTheRead(db.schedules)
    sent = await led_until_new_fired(db, store, entries, since, dispatchers)
    assert fire_id("new", since + second) not in sent, sent


async def test_a_read_of_creation_times_longer_than_its_first_bound_still_ends(
    fresh_db: Any,
) -> None:
    """Against the development server: a read that takes longer than its first bound (a
    first term reading every schedule of a large database) is given a longer one each
    time, and ends: with the same bound each time, it was read again for ever."""

    class Slow(ScheduleStore):
        reads = 0

        async def created_after(self, after: dt.datetime) -> dict[str, dt.datetime]:
            self.reads += 1
            await asyncio.sleep(0.3)  # the read's own length: its bound counts it
            return await super().created_after(after)

    store = Slow(fresh_db.schedules)
    lease = FixedLease()
    stores = dataclasses.replace(stores_over(fresh_db), store=store)
    dispatcher = Dispatcher(Mirrored({}), stores, AckingBroker([]), lease)
    async with Term(1, lease, {}) as term:
        read = dispatcher.takeover.created_after(term, None, 0.1)
        assert await asyncio.wait_for(read, 10) == {}
    assert store.reads >= 3  # bounds of 0.1 s and 0.2 s were too short


async def test_a_read_of_creation_times_ends_with_its_term() -> None:
    """Read again while the term holds, never after: a term that lost its lease stops
    reading (LeadershipLost), and the replica can lead again."""
    lease = FixedLease()
    store = Unreadable(unreachable_db(), 10**6, AutoReconnect("reset"))
    stores = dataclasses.replace(stores_over(unreachable_db()), store=store)
    dispatcher = Dispatcher(Mirrored({}), stores, AckingBroker([]), lease)
    async with Term(1, lease, {}) as term:
        reading = asyncio.create_task(dispatcher.takeover.created_after(term, None, 1.0))
        await wait_until(lambda: store.reads >= 2, 5, "a read tried again")
        lease.valid = False
        with pytest.raises(LeadershipLost):
            await asyncio.wait_for(reading, 5)


async def test_a_retry_turn_publishes_each_fire_once_and_its_batches_side_by_side() -> None:
    """A turn of the retry loop reads the claimed fires due for a retry with one cursor and
    publishes each batch as it is read, a second while the first awaits the broker (a new
    leader's adopted claims, thousands, went out one batch after another). Its marks are
    written behind the publishes: the turn ends once they are, so the next turn takes
    none of them again."""
    now = dt.datetime.now(dt.UTC)
    due = [
        Claim(f"s@{i}", "s", now - dt.timedelta(seconds=60), now - dt.timedelta(seconds=60))
        for i in range(3 * CLAIM_BATCH + 10)
    ]
    state = {c.fire_id: "claimed" for c in due}
    sent: list[str] = []
    side_by_side = asyncio.Event()

    class Retried(Ledger):
        async def due_for_retry(
            self, term: int, now: dt.datetime, limit: int, batch: int
        ) -> AsyncGenerator[list[Claim]]:
            read = [c for c in due if state[c.fire_id] == "claimed"][:limit]
            for i in range(0, len(read), batch):
                yield read[i : i + batch]

        async def mark_published_many(
            self, marks: list[tuple[list[str], int, dt.datetime, int]]
        ) -> None:
            for _ in range(3):  # the round trip: other tasks run meanwhile
                await asyncio.sleep(0)
            for fire_ids, *_ in marks:
                state.update(dict.fromkeys(fire_ids, "published"))

    class TwoAtOnce(AckingBroker):
        """The first publish is acknowledged once a second one is under way."""

        publishing = 0

        async def publish(
            self, messages: Sequence[FireMessage], timeout_s: float
        ) -> list[BaseException | None]:
            self.publishing += 1
            if self.publishing == 2:
                side_by_side.set()
            await side_by_side.wait()
            return await super().publish(messages, timeout_s)

    entries = {"s": Entry(1, False, Interval(60.0, now), 0.0, "all", 3600.0, "t.x")}
    db = unreachable_db()
    stores = dataclasses.replace(stores_over(db, Retried(db.fires)), store=OneSchedule())
    dispatcher = Dispatcher(Mirrored(entries), stores, TwoAtOnce(sent), FixedLease())
    term = await Term(1, FixedLease(), entries).__aenter__()
    await asyncio.wait_for(dispatcher.takeover.retry_due(term), 10)
    assert sorted(sent) == sorted(c.fire_id for c in due)  # each once
    assert set(state.values()) == {"published"}
    await dispatcher.takeover.retry_due(term)
    assert len(sent) == len(due)


async def test_a_successor_reads_the_ledger_before_claiming_what_its_predecessor_fired(
    fresh_db: Any,
) -> None:
    """Against the development server: a new leader's catch-up starts where the lease's
    watermark was last written, up to a fifth of a second and more before its
    predecessor stopped, so it meets fires that predecessor published. It reads the ledger
    for them rather than inserting claims the unique index refuses (each refusal cost the
    database ten times the read: a second's 10,000 fires held the first new fire back half
    a second), publishes none of them again, and goes on firing."""

    db = fresh_db
    recorded = ClaimsNoted(db.fires)
    now = dt.datetime.now(dt.UTC)
    base = now.replace(microsecond=0) - dt.timedelta(seconds=10)
    entries = {"s": Entry(1, False, Interval(1.0, base), 0.0, "all", 3600.0, "t.x")}
    # The predecessor (term 1) published every fire due by now.
    fired = [
        base + dt.timedelta(seconds=k) for k in range(11) if base + dt.timedelta(seconds=k) <= now
    ]
    for nominal in fired:
        doc = claim_document("s", nominal, nominal, 1, nominal)
        doc["state"] = PUBLISHED
        await db.fires.insert_one(doc)
    predecessors = {fire_id("s", nominal) for nominal in fired}
    sent: list[str] = []
    async with leading(
        db,
        recorded,
        entries,
        AckingBroker(sent),
        now - dt.timedelta(seconds=3),
    ):
        await wait_until(lambda: sent, 10, "the successor's first fire")
    assert not predecessors & set(sent)
    assert not predecessors & set(recorded.inserted)
    assert set(sent) <= set(recorded.inserted)  # its own fires: claimed, then published


async def test_a_successor_republishes_its_predecessors_latest_claims_first(fresh_db: Any) -> None:
    """Against the development server: a dead leader's claims due by the takeover are
    adopted and republished a batch at a time, latest due first. It published in due
    order, so its earlier claims are mostly published (duplicates to the broker) and its
    latest the likeliest not: behind 10,000 duplicates they came a third of a second
    later. Every one is published."""

    db = fresh_db
    now = dt.datetime.now(dt.UTC)
    entries = {"s": Entry(1, False, Interval(3600.0, now), 0.0, "all", 3600.0, "t.x")}
    # Inserted oldest first, as the dead leader claimed them: the order a plain read of
    # the collection returns.
    due = [now - dt.timedelta(milliseconds=k) for k in range(2 * CLAIM_BATCH + 500, 0, -1)]
    await db.fires.insert_many(
        [claim_document("s", d, d, 1, d - dt.timedelta(seconds=1)) for d in due]
    )
    sent: list[str] = []
    fires = AdoptionsNoted(db.fires)
    async with leading(db, fires, entries, AckingBroker(sent), now):
        await wait_until(lambda: len(sent) >= len(due), 20, "the adopted claims' publishes")
    latest_first = [fire_id("s", d) for d in reversed(due)]
    batches = [latest_first[i : i + CLAIM_BATCH] for i in range(0, len(due), CLAIM_BATCH)]
    assert fires.adoptions == [sorted(batch) for batch in batches]
    assert sorted(sent) == sorted(latest_first)


async def test_a_backlog_past_the_takeovers_bound_is_taken_by_the_retry_loop(
    fresh_db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against the development server: a takeover reads at most a turn of retries' worth
    of the claims left (a sorted read of an hour's backlog would be millions of
    documents); the retry loop adopts and publishes the rest, an older term's and this
    term's previous lead's alike."""
    from hascheduler.replica import takeover

    monkeypatch.setattr(takeover, "RETRY_BATCHES_PER_TURN", 1)
    db = fresh_db
    now = dt.datetime.now(dt.UTC)
    entries = {"s": Entry(1, False, Interval(3600.0, now), 0.0, "all", 3600.0, "t.x")}
    due = [now - dt.timedelta(milliseconds=k) for k in range(1, 2 * CLAIM_BATCH + 301)]
    # The oldest 300 were claimed by this term's previous lead, the rest by term 1.
    await db.fires.insert_many(
        [
            claim_document("s", d, d, 2 if i >= 2 * CLAIM_BATCH else 1, d - dt.timedelta(seconds=3))
            for i, d in enumerate(due)
        ]
    )
    sent: list[str] = []
    fires = AdoptionsNoted(db.fires)
    async with leading(db, fires, entries, AckingBroker(sent), now):
        await wait_until(lambda: len(set(sent)) >= len(due), 20, "every claim left published")

        async def none_claimed() -> bool:
            left: int = await db.fires.count_documents({"state": CLAIMED})
            return left == 0

        await wait_until(none_claimed, 10, "every claim marked published")
    # The takeover adopted the latest batch alone; the retry loop the rest.
    assert fires.adoptions == [sorted(fire_id("s", d) for d in due[:CLAIM_BATCH])]
    assert set(sent) == {fire_id("s", d) for d in due}


async def test_a_takeover_fires_what_falls_due_beside_republishing_what_fell_due_before(
    fresh_db: Any,
) -> None:
    """Against the development server: a new leader's first fires are not held behind its
    predecessor's claims being republished (10,000 of them took the first new fire a
    second past its due time), and until that republish and the catch-up after it end,
    the lease keeps the predecessor's watermark, so a leader after this one catches up
    from there."""

    db = fresh_db
    now = dt.datetime.now(dt.UTC)
    # "new" falls due 0.3 s into the term; "old" never again, but its predecessor's claim,
    # due a second ago, awaits its republish.
    entries = {
        "new": Entry(
            1, False, Interval(3600.0, now + dt.timedelta(seconds=0.3)), 0.0, "all", 3600.0, "t.x"
        ),
        "old": Entry(
            1, False, Interval(3600.0, now - dt.timedelta(seconds=1)), 0.0, "all", 3600.0, "t.x"
        ),
    }
    left = now - dt.timedelta(seconds=1)
    await db.fires.insert_one(claim_document("old", left, left, 1, left - dt.timedelta(seconds=1)))
    republish = asyncio.Event()
    sent: list[str] = []

    class HeldRepublish(AckingBroker):
        async def publish(
            self, messages: Sequence[FireMessage], timeout_s: float
        ) -> list[BaseException | None]:
            if any(m.fire_id == fire_id("old", left) for m in messages):
                await republish.wait()
            return await super().publish(messages, timeout_s)

    since = now - dt.timedelta(seconds=2)
    async with leading(db, Ledger(db.fires), entries, HeldRepublish(sent), since) as dispatcher:
        await wait_until(lambda: sent, 5, "the new fire beside the held republish")
        assert sent == [fire_id("new", now + dt.timedelta(seconds=0.3))]
        assert dispatcher.fired_through == since
        republish.set()
        await wait_until(
            lambda: dispatcher.fired_through not in (None, since),
            5,
            "the watermark moving once the take-over ended",
        )
        assert fire_id("old", left) in sent


async def test_a_schedule_created_while_a_term_starts_fires_nothing_before_its_creation(
    fresh_db: Any,
) -> None:
    """Against the development server: the mirror applies a schedule created just after
    the term took its start time, before its seed. The seed plans it from its creation,
    not from the term's start: its first fire is the first after its creation, never one
    between the two (made_since, which the audit expects; the soak saw one)."""
    db = fresh_db
    await db.schedules.insert_one(
        {"_id": "new", "name": "new", "target": "t.x", "payload": {}, "revision": 1}
    )
    await Ledger(db.fires).ensure_indexes(3600)
    entries: dict[str, Entry] = {}
    began: list[dt.datetime] = []
    second = dt.timedelta(seconds=1)

    def clock() -> dt.datetime:
        now = dt.datetime.now(dt.UTC)
        if not began:  # the term's start time: the creation is applied at its next await
            began.append(now)
            asyncio.get_running_loop().call_soon(create)
        return now

    def create() -> None:
        # Created half a second past the first whole second after the term's start.
        created = began[0].replace(microsecond=0) + 1.5 * second
        entries["new"] = Entry(
            1, False, Interval(1.0, created - 60.5 * second), 0.0, "all", 60.0, "t.x"
        )
        dispatcher.on_change("new", entries["new"], Written(created, created))

    sent: list[str] = []
    lease = FixedLease(term=2, ttl_s=1.0)
    dispatcher = Dispatcher(
        Mirrored(entries), stores_over(db), AckingBroker(sent), lease, clock=clock
    )
    view = LeaseView("b", 2, dt.datetime.now(dt.UTC) + second, fired_through=None)
    lead = asyncio.create_task(dispatcher.lead(view))
    try:
        await wait_until(lambda: sent, 5, "the new schedule's first fire")
        first_whole = began[0].replace(microsecond=0) + second
        assert sent[0] == fire_id("new", first_whole + second), (began, sent)
        assert fire_id("new", first_whole) not in sent
    finally:
        lead.cancel()
        await asyncio.gather(lead, return_exceptions=True)


async def test_a_schedule_stamped_as_created_after_the_terms_start_fires_nothing_before(
    fresh_db: Any,
) -> None:
    """Against the development server: a schedule in the mirror before the term begins,
    whose creation another replica stamped after the term's start (its clock bound ran
    ahead of the leader's), is seeded from its stamp: no fire between the two, which the
    audit would count as one before its creation."""
    db = fresh_db
    second = dt.timedelta(seconds=1)
    now = dt.datetime.now(dt.UTC)
    created = now.replace(microsecond=0) + 1.5 * second
    await db.schedules.insert_one(
        {"_id": "ahead", "target": "t.x", "payload": {}, "revision": 1, "created_at": created}
    )
    await Ledger(db.fires).ensure_indexes(3600)
    entries = {
        "ahead": Entry(1, False, Interval(1.0, created - 60.5 * second), 0.0, "all", 60.0, "t.x")
    }
    sent: list[str] = []
    lease = FixedLease(term=2, ttl_s=1.0)
    dispatcher = Dispatcher(Mirrored(entries), stores_over(db), AckingBroker(sent), lease)
    view = LeaseView("b", 2, now + second, fired_through=now)
    lead = asyncio.create_task(dispatcher.lead(view))
    try:
        await wait_until(lambda: sent, 5, "the schedule's first fire")
        first_whole = now.replace(microsecond=0) + second
        assert sent[0] == fire_id("ahead", first_whole + second), (now, sent)
        assert fire_id("ahead", first_whole) not in sent
    finally:
        lead.cancel()
        await asyncio.gather(lead, return_exceptions=True)
