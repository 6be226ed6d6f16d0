"""The dispatcher: retry backoff, seeding that lets the loop run, and taking over a deposed
leader's claim (against the development server)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
import structlog.testing
from pymongo.errors import AutoReconnect, DuplicateKeyError, ExecutionTimeout, NetworkTimeout

from hascheduler.brokers.base import BrokerUnavailable
from hascheduler.core.catchup import (
    LATE_CHANGE_S,
    LATE_FIRES_MAX,
    late_fires,
    plan_catchups,
    replan_from,
)
from hascheduler.core.claims import Claim, none_withdrawn, withdrawn
from hascheduler.core.entries import Entry, Written
from hascheduler.core.fanout import FanOut
from hascheduler.core.fire_queue import SEED_STEP, Due
from hascheduler.core.triggers import At, Interval, fire_id
from hascheduler.replica.backfilling import BACKFILL_QUIET_S, Backfilling
from hascheduler.replica.dispatch import CLAIM_EVERY_S, Dispatcher
from hascheduler.replica.firing import (
    ADMIT_AHEAD_S,
    CLAIM_AHEAD_S,
    CLAIM_BATCH,
    CLAIMS_IN_FLIGHT,
    PUBLISH_TICK_S,
    publish_tick,
)
from hascheduler.replica.overlap import Fenced
from hascheduler.replica.publishing import DispatchSettings, backoff_s
from hascheduler.replica.term import LeadershipLost, Term
from tests.waiting import still_pending, wait_until

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def at(minutes: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


def test_backoff_is_full_jitter_capped_exponential() -> None:
    assert backoff_s(1, 0.5, 30, 1.0) == 1.0
    assert backoff_s(3, 0.5, 30, 1.0) == 4.0
    assert backoff_s(20, 0.5, 30, 1.0) == 30.0
    assert backoff_s(3, 0.5, 30, 0.25) == 1.0
    assert backoff_s(3, 0.5, 30, 0.0) == 0.0


def test_a_fire_is_published_at_the_end_of_its_tick_never_before_its_due_time() -> None:
    tick = dt.timedelta(seconds=PUBLISH_TICK_S)
    assert publish_tick(T0) == T0  # on a tick's edge: at once
    for offset_us in (1, 1_000, 4_999, 5_000, 5_001, 999_999):
        due = T0 + dt.timedelta(microseconds=offset_us)
        published = publish_tick(due)
        assert due <= published < due + tick
        assert (published - T0) % tick == dt.timedelta(0)
    # Fires due within one tick go out together.
    assert publish_tick(T0 + dt.timedelta(microseconds=1)) == publish_tick(T0 + tick)


async def test_seeding_lets_the_loop_run_and_a_change_meanwhile_is_queued() -> None:
    def entry(revision: int, every_s: float = 60.0) -> Entry:
        return Entry(revision, False, Interval(every_s, T0), 0.0, "all", 3600.0, "t")

    entries = {f"s{i:05d}": entry(1) for i in range(3 * SEED_STEP)}
    lease = SimpleNamespace(valid=True, term=1)
    dispatcher = Dispatcher(SimpleNamespace(entries=entries), None, None, None,  # type: ignore[arg-type]
                            lease)  # type: ignore[arg-type]
    term = dispatcher.term = await Term(1, lease, entries).__aenter__()  # type: ignore[arg-type]
    turns = 0
    seeded = False

    async def meanwhile() -> None:
        nonlocal turns
        while not seeded:
            turns += 1
            if turns == 1:  # s00000 was visited before the first step; now it changes
                entries["s00000"] = entry(2, every_s=30.0)
                dispatcher.on_change("s00000", entries["s00000"])
            await asyncio.sleep(0)

    other = asyncio.create_task(meanwhile())
    await dispatcher._seed(term, at(0.25))
    seeded = True
    await other
    assert turns >= 2, "the seed never let another task run"
    queued = {(d.revision, d.nominal) for d in term.queue.items()
              if d.schedule_id == "s00000"}
    assert (2, at(0.5)) in queued, queued


async def test_a_fan_out_fire_waits_for_its_source_and_holds_the_lease_watermark() -> None:
    """A fire whose source mirror is loading is claimed once it is in sync, and until then
    the watermark the lease records stays before it (a next leader's catch-up covers it)."""
    fan_out = FanOut.model_validate({"collection": "tenants"})
    entry = Entry(1, False, Interval(60.0, T0), 0.0, "all", 3600.0, "t", fan_out)
    in_sync = asyncio.Event()

    class Sources:
        def tenants(self, wanted: FanOut) -> list[str] | None:
            return ["a", "b"] if in_sync.is_set() else None

        async def wait_ready(self, wanted: FanOut, timeout_s: float) -> bool:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(in_sync.wait(), timeout_s)
            return in_sync.is_set()

    now = dt.datetime.now(dt.UTC)
    lease = SimpleNamespace(valid=True, term=1)
    dispatcher = Dispatcher(SimpleNamespace(entries={"f": entry}), None, None, None,  # type: ignore[arg-type]
                            lease,  # type: ignore[arg-type]
                            clock=lambda: now, sources=Sources())
    term = dispatcher.term = await Term(1, lease, {"f": entry}).__aenter__()  # type: ignore[arg-type]
    term.advance(now)
    claimed: list[Claim] = []

    async def claim(claims: list[Claim], term: Term, now: dt.datetime,
                    backfill: str | None = None) -> list[Claim]:
        claimed.extend(claims)
        return []  # nothing to publish in this test

    dispatcher.firing.claim = claim  # type: ignore[method-assign]
    due = Due(now + dt.timedelta(seconds=1), now + dt.timedelta(seconds=1), "f", 1)
    await dispatcher.firing.claim_and_publish([due], term, now)
    assert claimed == []
    held = dispatcher.fired_through
    assert held is not None
    assert held < due.fire_at

    in_sync.set()

    async def expanded() -> bool:
        return len(claimed) == 2

    await wait_until(expanded, 5, "the fire claimed once its source is in sync")
    assert [c.tenant for c in claimed] == ["a", "b"]

    async def released() -> bool:
        return dispatcher.fired_through == now

    await wait_until(released, 5, "the watermark released")


async def test_a_databases_first_term_records_no_watermark_while_it_catches_up() -> None:
    """A term that took over no watermark (no term of the database had fired) has the
    lease record none while its catch-up runs: a next leader then catches each schedule up
    from its creation again, not from this term's start. One that took a watermark over
    has the lease keep it until then."""
    now = dt.datetime.now(dt.UTC)
    lease = SimpleNamespace(valid=True, term=1)
    async with Term(1, lease, {}) as term:  # type: ignore[arg-type]
        term.advance(now)
        term.take_over(None)
        assert term.fired_through is None
        term.take_over(now - dt.timedelta(minutes=1))
        assert term.fired_through == now - dt.timedelta(minutes=1)
        term.caught_up()
        assert term.fired_through == now


@contextlib.asynccontextmanager
async def changes_applied(entries: dict[str, Entry], watermark: dt.datetime | None
                          ) -> AsyncIterator[tuple[Dispatcher, Term]]:
    """A dispatcher over ``entries`` leading a term whose loop has got to ``watermark``
    (no database, no broker: for what a change queues)."""
    lease = SimpleNamespace(valid=True, term=1)
    dispatcher = Dispatcher(SimpleNamespace(entries=entries), None, None, None,  # type: ignore[arg-type]
                            lease)  # type: ignore[arg-type]
    async with Term(1, lease, entries) as term:  # type: ignore[arg-type]
        dispatcher.term = term
        if watermark is not None:
            term.advance(watermark)
        yield dispatcher, term


async def test_a_change_applied_after_the_watermark_passed_its_fire_still_fires() -> None:
    """The mirror applies a new one-off after the loop has passed its instant (its change
    stream lagging, or the schedule written just before the term began): planned from the
    watermark, the fire was never queued. Planned from the change's commit it is queued
    at once, and the lease's watermark waits before it until it is claimed; a change with
    no commit time (a load's) is planned from the watermark, as before."""
    w = dt.datetime.now(dt.UTC)
    second = dt.timedelta(seconds=1)
    late = dt.timedelta(seconds=LATE_CHANGE_S)
    def made(at: dt.datetime | None, created_at: dt.datetime | None = None) -> Written:
        return Written(at, created_at)

    assert replan_from(w, made(w - 3 * second)) == w - 3 * second
    assert replan_from(w, made(w + second)) == w  # applied in time: from the watermark
    assert replan_from(w, None) == w  # a load's: from the watermark
    assert replan_from(w, made(None)) == w  # a server before MongoDB 6.0
    assert replan_from(None, made(w)) is None  # not yet seeded: the seed reads it
    assert replan_from(w, made(w - 2 * late)) == w - late  # at most LATE_CHANGE_S back
    # A new schedule from its creation, whenever its write was committed (held up past the
    # watermark, say), and never from before it: what fell due then was never due.
    assert replan_from(w, made(w - 2 * second, w - 3 * second)) == w - 3 * second
    assert replan_from(w, made(w + second, w - 3 * second)) == w - 3 * second
    assert replan_from(w, made(w + second, w + second / 2)) == w + second / 2
    assert replan_from(w, made(w + second, w - 2 * late)) == w - late

    def one_off(at: dt.datetime, revision: int = 1) -> Entry:
        return Entry(revision, False, At((at,)), 0.0, "all", 3600.0, "t")

    entries: dict[str, Entry] = {}
    async with changes_applied(entries, w) as (dispatcher, term):
        with structlog.testing.capture_logs() as logged:
            for schedule_id, at, written in [("late", w - second, made(w - 2 * second)),
                                             ("loaded", w - second, None),
                                             ("lost", w - 2 * late, made(w - 3 * late))]:
                entries[schedule_id] = one_off(at)
                dispatcher.on_change(schedule_id, entries[schedule_id], written)
        # Only the change past the bound, whose fire is lost, is said to be late.
        assert [(e["event"], e["schedule_id"]) for e in logged
                if e["log_level"] == "warning"] == [("change_applied_late", "lost")]
        assert [(d.schedule_id, d.fire_at) for d in term.queue.items()] == [
            ("late", w - second)]
        assert term.fired_through == w - second - dt.timedelta(microseconds=1)
        assert term.queue.take_due(w, 10)[0].schedule_id == "late"
        assert term.fired_through == w


async def test_a_schedule_created_after_the_watermark_fires_nothing_due_before_it() -> None:
    """The loop last ran 10 ms before a whole second; a per-second cron created 10 ms
    after that second is applied at once. Planned from the watermark, that second (before
    the schedule existed) was fired; planned from its creation, its first fire is the
    next second."""
    second = dt.timedelta(seconds=1)
    ms = dt.timedelta(milliseconds=1)
    w = T0 - 10 * ms
    entries = {"new": Entry(1, False, Interval(1.0, T0 - 60 * second), 0.0, "all", 3600.0,
                            "t")}
    async with changes_applied(entries, w) as (dispatcher, term):
        dispatcher.on_change("new", entries["new"], Written(T0 + 12 * ms, T0 + 10 * ms))
        assert [d.nominal for d in term.queue.items()] == [T0 + second]


def test_a_catch_up_fires_what_the_previous_leader_passed_before_it_learned_of_a_schedule(
        ) -> None:
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
    fan_out = Entry(1, False, every, 0.0, "latest", 3600.0, "t.x",
                    fan_out=FanOut(collection="tenants"))
    seconds = [since + dt.timedelta(seconds=k) for k in range(-4, 4)]  # since-4 .. since+3
    fire, skipped = plan_catchups(
        [("late", entry("latest")), ("late-none", entry("none")), ("known", entry("latest")),
         ("new", entry("all")), ("fan-out", fan_out)], since, now,
        {"late": since - dt.timedelta(seconds=4.5),
         "late-none": since - dt.timedelta(seconds=4.5),
         "new": since + dt.timedelta(seconds=1.5),
         "fan-out": since - dt.timedelta(seconds=4.5)})
    fired = {sid: sorted(d.nominal for d in fire if d.schedule_id == sid)
             for sid in ("late", "late-none", "known", "new", "fan-out")}
    assert fired["late"] == [*seconds[:5], seconds[-1]]  # since-4 .. since, then the latest
    assert fired["late-none"] == seconds[:5]
    assert fired["known"] == [seconds[-1]]
    assert fired["new"] == seconds[-2:]  # created after since: from its creation, as before
    assert fired["fan-out"] == [*seconds[:5], seconds[-1]]
    # A database's first term (no watermark): each from its creation, by its policy.
    first, _ = plan_catchups([("late", entry("latest"))], None, now,
                              {"late": since - dt.timedelta(seconds=4.5)})
    assert [d.nominal for d in first] == [seconds[-1]]
    # The skipped ranges are those of the policies, after since only.
    assert {sid: (r.first, r.last) for sid, r in skipped} == {
        "late": (seconds[5], seconds[6]), "late-none": (seconds[5], seconds[7]),
        "known": (seconds[5], seconds[6]), "fan-out": (seconds[5], seconds[6])}


async def test_a_change_applied_while_a_term_starts_fires_what_fell_due_before_it() -> None:
    """The mirror applies a new schedule (its write held up) while a term starts, before
    the term has a watermark: the term's seed plans it from the term's start, and, the
    catch-up having read creation times before it was committed, nothing planned its
    instants between its creation and the start. The change is kept with its times, and
    once seeded those instants are claimed (late_fires), as a late change's are."""
    second = dt.timedelta(seconds=1)
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    every = Interval(1.0, now - 60 * second)
    entries = {"new": Entry(1, False, every, 0.0, "all", 3600.0, "t.x"),
               "changed": Entry(2, False, every, 0.0, "all", 3600.0, "t.x"),
               "paused": Entry(1, True, every, 0.0, "all", 3600.0, "t.x"),
               "fan-out": Entry(1, False, every, 0.0, "all", 3600.0, "t.x",
                                fan_out=FanOut(collection="tenants"))}
    async with changes_applied(entries, None) as (dispatcher, term):
        dispatcher.on_change("new", entries["new"], Written(now, now - 2.5 * second))
        dispatcher.on_change("new", entries["new"], Written(now, None))  # the first counts
        dispatcher.on_change("changed", entries["changed"], Written(now - 1.5 * second, None))
        dispatcher.on_change("paused", entries["paused"], Written(now, now - 2.5 * second))
        dispatcher.on_change("fan-out", entries["fan-out"], Written(now, now - 2.5 * second))
        dispatcher.on_change("loaded", None, None)
        assert set(term.early_changes) == {"new", "changed", "paused", "fan-out"}
        due = late_fires(term.early_changes, entries, now)
        # A fan-out's too, for the tenants it selects when claimed (no carve-out).
        assert [(d.schedule_id, d.nominal) for d in due] == [
            ("fan-out", now - 2 * second), ("new", now - 2 * second),
            ("changed", now - second), ("fan-out", now - second), ("new", now - second),
            ("changed", now), ("fan-out", now), ("new", now)]
        # Made after the term's start, or more than LATE_CHANGE_S before it: from the
        # start, or from LATE_CHANGE_S back.
        assert late_fires({"new": Written(now + second, now + second)}, entries, now) == []
        far = late_fires({"new": Written(now, now - 60 * second)}, entries, now)
        assert len(far) == LATE_CHANGE_S
        # Valid but expensive: a trigger every half millisecond makes 20,000 fires in
        # those 10 s; at most LATE_FIRES_MAX are planned, in both late paths.
        dense = {"dense": Entry(1, False, Interval(0.0005, now - 60 * second), 0.0, "all",
                                3600.0, "t.x")}
        assert len(late_fires({"dense": Written(now, now - 60 * second)}, dense, now)) == \
            LATE_FIRES_MAX
        caught, _ = plan_catchups(list(dense.items()), now, now,
                                   {"dense": now - LATE_CHANGE_S * second})
        assert len(caught) == LATE_FIRES_MAX  # the late ones; after the watermark, none due


async def test_creation_times_that_cannot_be_read_leave_the_catch_up_from_the_watermark(
        ) -> None:
    """A failed or timed-out read of the schedules' creation times is no reason to stop
    leading: the catch-up goes on from the watermark (or the term's start), as before
    creation times were read."""
    class Unreadable:
        def __init__(self, error: Exception) -> None:
            self.error = error

        def find(self, *args: Any, **kwargs: Any) -> Any:
            raise self.error

    lease = SimpleNamespace(valid=True, term=1)
    async with Term(1, lease, {}) as term:  # type: ignore[arg-type]
        for error in (ExecutionTimeout("operation exceeded time limit"),
                      AutoReconnect("connection reset")):
            dispatcher = Dispatcher(SimpleNamespace(entries={}), Unreadable(error),  # type: ignore[arg-type]
                                    None, None, lease)  # type: ignore[arg-type]
            assert await dispatcher.takeover.created_after(term, None) == {}


async def test_an_unavailable_broker_is_waited_out_and_a_refusal_is_not() -> None:
    """BrokerUnavailable is retried past the attempt limit, with a short backoff, until
    max_unavailable_s past the due time; a refusal fails at the attempt limit."""
    now = dt.datetime.now(dt.UTC)
    recorded: list[tuple[str, str, float | None]] = []

    class Ledger:
        async def mark_failed(self, fire_id: str, term: int, attempt: int, error: str,
                              at: dt.datetime) -> None:
            recorded.append((fire_id, "failed", None))

        async def retry_later(self, fire_id: str, term: int, attempt: int, error: str,
                              at: dt.datetime) -> None:
            recorded.append((fire_id, "retry", (at - now).total_seconds()))

    settings = DispatchSettings(max_attempts=3, unavailable_backoff_cap_s=2.0,
                                max_unavailable_s=300.0)
    dispatcher = Dispatcher(SimpleNamespace(entries={}), None, Ledger(), None,  # type: ignore[arg-type]
                            SimpleNamespace(valid=True), settings, clock=lambda: now)  # type: ignore[arg-type]
    def claim(fire: str, due: dt.datetime) -> Claim:
        return Claim(fire, "s", due, due)

    recent = claim("recent", now - dt.timedelta(seconds=10))
    old = claim("old", now - dt.timedelta(seconds=301))
    publisher = dispatcher.publisher
    for attempt in range(1, 8):
        await publisher.record_failure(recent, 1, attempt, BrokerUnavailable("down"))
    await publisher.record_failure(old, 1, 3, BrokerUnavailable("down"))
    await publisher.record_failure(claim("refused", recent.due_at), 1, 3,
                                   RuntimeError("refused"))
    waits = [wait for fire, what, wait in recorded if fire == "recent"]
    assert len(waits) == 7
    assert all(wait is not None and 0 <= wait <= 2.0 for wait in waits), waits
    assert ("old", "failed", None) in recorded
    assert ("refused", "failed", None) in recorded


class InsertsNoted:
    """A collection that notes the id of every document it is asked to insert."""

    def __init__(self, collection: Any) -> None:
        self._collection = collection
        self.inserted: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._collection, name)

    async def insert_many(self, docs: list[dict[str, Any]], **kwargs: Any) -> Any:
        self.inserted.extend(str(d["_id"]) for d in docs)
        return await self._collection.insert_many(docs, **kwargs)


@pytest.mark.parametrize("contested", [False, True])
async def test_a_claim_taken_by_a_deposed_leader_is_adopted_when_it_falls_due(
        mongo_uri: str, contested: bool) -> None:
    """Against the development server: a duplicate key on claiming means another claim;
    only an unpublished one from an older term is taken over (with our term), never a
    published one, a newer term's, or one this replica is already publishing. The same
    when the fires are due while a term before may have claimed them (``contested``): the
    ledger is read first, and only the fire not in it is inserted."""
    import uuid
    from types import SimpleNamespace

    from pymongo import AsyncMongoClient

    from hascheduler.replica.dispatch import Dispatcher
    from hascheduler.storage import fires as ledger
    from tests.servers import with_database

    client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(
        with_database(mongo_uri, f"adopt_{uuid.uuid4().hex[:8]}"), tz_aware=True)
    try:
        fires = client.get_default_database().fires
        now = at(10)
        lease = SimpleNamespace(valid=True, term=2, remaining=lambda: 5.0,
                                timings=SimpleNamespace(ttl=10.0))
        dispatcher = Dispatcher(SimpleNamespace(entries={}), None,  # type: ignore[arg-type]
                                ledger.Ledger(recorded := InsertsNoted(fires)),  # type: ignore[arg-type]
                                None, lease, clock=lambda: now)  # type: ignore[arg-type]
        term = await Term(2, lease, {}).__aenter__()  # type: ignore[arg-type]
        if contested:
            term.contest_until(at(10))
        def claim(sid: str, term: int) -> dict[str, object]:
            return ledger.claim_document(sid, at(10), at(10), term, at(9.99))

        deposed, published, newer, ours = (claim("deposed", 1), claim("published", 1),
                                           claim("newer", 3), claim("ours", 2))
        published["state"] = ledger.PUBLISHED
        await fires.insert_many([deposed, published, newer, ours])
        term.add_pending([Claim(str(ours["_id"]), "ours", at(10), at(10))])

        mine = [Claim(fire_id(sid, at(10)), sid, at(10), at(10))
                for sid in ("deposed", "published", "newer", "ours", "fresh")]
        owned = await dispatcher.firing.claim(mine, term, at(9.99))

        assert sorted(c.fire_id for c in owned) == [
            fire_id("deposed", at(10)), fire_id("fresh", at(10))]
        stored = {d["schedule_id"]: d async for d in fires.find({})}
        assert (stored["deposed"]["term"], stored["deposed"]["claimed_at"]) == (2, now)
        assert stored["deposed"]["state"] == ledger.CLAIMED
        assert (stored["published"]["term"], stored["published"]["state"]) == (1, "published")
        assert stored["newer"]["term"] == 3
        assert stored["ours"]["claimed_at"] == at(9.99)  # untouched: already ours, in flight
        assert stored["fresh"]["term"] == 2
        assert recorded.inserted == (
            [mine[-1].fire_id] if contested else [c.fire_id for c in mine])
    finally:
        await client.close()


async def test_a_term_acts_only_while_it_holds_the_lease() -> None:
    """The fence, asked of the term alone: a lapsed renew deadline or a newer term on the
    lease stops it, and leaving it empties its queue and cancels its waits."""
    entries = {"s": Entry(1, False, Interval(60.0, T0), 0.0, "all", 3600.0, "t")}
    lease = SimpleNamespace(valid=True, term=4)
    async with Term(4, lease, entries) as term:  # type: ignore[arg-type]
        term.check()
        assert term.holds
        lease.term = 5  # re-elected: a new term, not this one
        assert not term.holds
        with pytest.raises(LeadershipLost):
            term.check()
        lease.term, lease.valid = 4, False  # the renew deadline passed
        with pytest.raises(LeadershipLost):
            term.check()
        list(term.queue.seed(at(0)))
        assert list(term.queue.items())
        never = asyncio.Event()
        term.start_waiting(never.wait())  # type: ignore[arg-type]
        (waiting,) = term._waiting
    assert not term.active
    assert list(term.queue.items()) == []
    await asyncio.wait({waiting}, timeout=5)
    assert waiting.cancelled()


async def test_a_terms_write_outlives_its_cancelled_caller_and_settle_waits_for_it() -> None:
    """A write whose caller is cancelled (the handover stops the lead) goes on to its
    answer, and ``settle`` returns once it has it: the lease is released after the write
    was applied or refused, never while it may still land."""
    lease = SimpleNamespace(valid=True, term=1, remaining=lambda: 5.0,
                            timings=SimpleNamespace(ttl=2.0))
    answer = asyncio.Event()
    applied: list[str] = []

    async def claim() -> str:
        await answer.wait()
        applied.append("claim")
        return "claim"

    async with Term(1, lease, {}) as term:  # type: ignore[arg-type]
        caller = asyncio.create_task(term.write(claim()))
        await wait_until(lambda: term._writes.tasks, 5, "the write in flight")
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        settling = asyncio.create_task(term.settle(5.0))
        await still_pending(settling, 0.2, "the settle with a write unanswered")
        assert not applied
        answer.set()
        assert await settling
        assert applied == ["claim"]
        assert await term.settle(0.0)  # nothing in flight


@pytest.mark.parametrize(("error", "settled"), [
    (AutoReconnect("connection lost mid-write"), False),  # sent, fate unknown
    (NetworkTimeout("timed out waiting for the reply"), False),
    (DuplicateKeyError("E11000"), True),  # the server answered: refused
    (ExecutionTimeout("operation exceeded time limit", 50), True),
])
async def test_a_write_that_ended_unanswered_keeps_the_lease_from_being_released(
        error: Exception, settled: bool) -> None:
    lease = SimpleNamespace(valid=True, term=1, remaining=lambda: 5.0,
                            timings=SimpleNamespace(ttl=60.0))

    async def failing() -> None:
        raise error

    async with Term(1, lease, {}) as term:  # type: ignore[arg-type]
        with pytest.raises(type(error)):
            await term.write(failing())
        assert await term.settle(1.0) is settled


async def test_a_write_past_what_remains_of_the_term_ends_the_term() -> None:
    left = [0.05]
    lease = SimpleNamespace(valid=True, term=1, remaining=lambda: left[0],
                            timings=SimpleNamespace(ttl=60.0))
    async with Term(1, lease, {}) as term:  # type: ignore[arg-type]
        with pytest.raises(LeadershipLost):
            await term.write(asyncio.Event().wait())
        # Still in flight once the term gave up on it: the release waits, then lapses.
        assert not await term.settle(0.05)
    # The same term led again (the dispatcher's next lead) answers for that write too.
    async with Term(1, lease, {}) as again:  # type: ignore[arg-type]
        again.follows(term)
        assert not await again.settle(0.05)
        held = list(again._writes.tasks)
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        assert not again._writes.tasks
        assert not await again.settle(0.05)  # ended unanswered, within the ttl


async def test_a_backfill_is_worked_only_in_the_quiet_between_regular_fires() -> None:
    """A backfill's chunk waits while a regular publish or claim is due within
    BACKFILL_QUIET_S, so its claims and publishes never land in front of a cron's
    second; with nothing due soon, it goes."""
    now = T0 + dt.timedelta(seconds=59)  # the schedule fires every minute from T0
    entries = {"s": Entry(1, False, Interval(60.0, T0), 0.0, "all", 3600.0, "t")}
    lease = SimpleNamespace(valid=True, term=1)
    dispatcher = Dispatcher(SimpleNamespace(entries=entries), None, None, None,  # type: ignore[arg-type]
                            lease, clock=lambda: now)  # type: ignore[arg-type]
    quiet = dt.timedelta(seconds=BACKFILL_QUIET_S)
    backfilling = Backfilling(None, None, entries, dispatcher.firing.claim_and_publish,  # type: ignore[arg-type]
                              lambda: False, lambda: now, CLAIM_AHEAD_S)
    async with Term(1, lease, entries) as term:  # type: ignore[arg-type]
        assert backfilling.quiet(term)  # nothing due at all
        soon, later = now + quiet / 2, now + quiet * 2
        first, second, third = (Claim(f"f{i}", "s", due, due)
                                for i, due in enumerate((soon, soon, later)))
        term.add_pending([first, second, third, first])  # a claim counted once
        assert term.next_publish_at() == soon
        assert not backfilling.quiet(term)  # a regular publish is due within the window
        term.remove_pending([first, first])
        assert not backfilling.quiet(term)  # the other one still is
        term.remove_pending([second])
        assert term.next_publish_at() == later
        assert backfilling.quiet(term)
        # The queue's first fire is claimed CLAIM_AHEAD_S before it is due: the claims
        # need the path too. Due in a second: its claim is now; in a minute: quiet.
        list(term.queue.seed(now))
        assert term.queue.first_at() == now + dt.timedelta(seconds=1)
        assert dt.timedelta(seconds=1 - CLAIM_AHEAD_S) < quiet
        assert not backfilling.quiet(term)
        term.queue.clear()
        list(term.queue.seed(now + dt.timedelta(seconds=2)))
        assert term.queue.first_at() == now + dt.timedelta(seconds=61)
        assert backfilling.quiet(term)
        term.queue.clear()
        term.remove_pending([third])
        assert term.next_publish_at() is None
        assert term.pending == {}
        assert backfilling.quiet(term)


def test_claims_none_withdrawn_are_those_still_due_would_keep_all_of() -> None:
    """The check made ahead (none_withdrawn) says yes only where the one at the due time
    (still_due, through withdrawn) keeps every claim."""
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    every = Interval(1.0, now - dt.timedelta(seconds=60))
    entries = {"s": Entry(1, False, every, 0.0, "all", 3600.0, "t.x"),
               "changed": Entry(2, False, every, 0.0, "all", 3600.0, "t.x"),
               "moved": Entry(2, False, Interval(1.0, now - dt.timedelta(seconds=59.5)),
                              0.0, "all", 3600.0, "t.x"),
               "paused": Entry(1, True, every, 0.0, "all", 3600.0, "t.x"),
               "until": Entry(1, True, every, 0.0, "all", 3600.0, "t.x",
                              paused_until=now + dt.timedelta(seconds=5)),
               "completed": Entry(1, False, every, 0.0, "all", 3600.0, "t.x",
                                  completed=True)}
    revisions = {s: 1 for s in (*entries, "deleted")}

    def claim(sid: str, tenant: str | None = None) -> Claim:
        return Claim(fire_id(sid, now), sid, now, now, tenant=tenant)

    assert none_withdrawn([claim("s"), claim("changed")], entries, revisions)
    assert withdrawn(claim("changed"), entries["changed"], 1) is None  # still a fire time
    for gone in ("moved", "paused", "until", "completed", "deleted"):
        assert withdrawn(claim(gone), entries.get(gone), 1) is not None
        assert not none_withdrawn([claim("s"), claim(gone)], entries, revisions)
    # A tenant's claim waits for the selection at its due time.
    assert not none_withdrawn([claim("s", tenant="acme")], entries, revisions)
    assert withdrawn(claim("s", tenant="acme"), entries["s"], 1) is not None  # no fan-out


class NotedPublisher:
    """The publisher of claims awaiting their due time (FiringPath.publish_when_due),
    noting each call: what, the fire ids, when; a publish's ``admitted`` and ``unchanged``
    too. It admits every claim, and counts no change unless a test says so."""

    def __init__(self) -> None:
        self.changes = 0
        self.events: list[tuple[str, list[str], dt.datetime]] = []
        self.published: list[tuple[list[str], bool, bool]] = []

    def _note(self, what: str, claims: list[Claim]) -> None:
        self.events.append((what, [c.fire_id for c in claims], dt.datetime.now(dt.UTC)))

    async def templates(self, ids: set[str]) -> dict[str, object]:
        return {}

    def prepare(self, claims: list[Claim]) -> None:
        self._note("prepare", claims)

    def discard(self, claims: list[Claim]) -> None:
        self._note("discard", claims)

    async def admit(self, claims: list[Claim], term: Fenced
                    ) -> tuple[list[Claim], list[Claim]]:
        self._note("admit", claims)
        return claims, []

    def ready(self, claims: list[Claim], term: int) -> None:
        self._note("ready", claims)

    async def unadmit(self, claims: list[Claim], term: int) -> None:
        self._note("unadmit", claims)

    async def publish(self, claims: list[Claim], term: Fenced, attempt: int,
                      admitted: bool = False, unchanged: bool = False) -> None:
        self._note("publish", claims)
        self.published.append(([c.fire_id for c in claims], admitted, unchanged))


def publishing_dispatcher(entries: dict[str, Entry], publisher: NotedPublisher,
                          ledger: Any = None) -> tuple[Dispatcher, Any]:
    """A dispatcher over ``entries`` publishing through ``publisher``, and its lease."""
    lease = SimpleNamespace(valid=True, term=1, remaining=lambda: 5.0,
                            timings=SimpleNamespace(ttl=10.0))
    dispatcher = Dispatcher(SimpleNamespace(entries=entries), None, ledger, None,  # type: ignore[arg-type]
                            lease)  # type: ignore[arg-type]
    dispatcher.publisher = dispatcher.firing.publisher = publisher  # type: ignore[assignment]
    return dispatcher, lease


async def test_claims_unchanged_since_their_check_are_published_without_another(
        ) -> None:
    """Nothing changed (the publisher's count of changes) between the check made once the
    claims are in and their due time: they are published as they are, no look at each
    then (_still_due), and the publisher takes their templates as rendered."""
    due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=0.4)
    entries = {s: Entry(1, False, Interval(60.0, T0), 0.0, "all", 3600.0, "t")
               for s in ("a", "b")}
    publisher = NotedPublisher()
    dispatcher, lease = publishing_dispatcher(entries, publisher)

    async def not_asked(*args: Any) -> list[Claim]:
        raise AssertionError("checked again at the due time")

    dispatcher.firing.still_due = not_asked  # type: ignore[method-assign]
    claims = [Claim(f"{s}@x", s, due, due) for s in ("a", "b")]
    async with Term(1, lease, entries) as term:  # type: ignore[arg-type]
        term.add_pending(claims)
        await dispatcher.firing.publish_when_due(claims, {"a": 1, "b": 1}, term)
    assert publisher.published == [(["a@x", "b@x"], True, True)]


@pytest.mark.alone  # times the admission against the real clock: on an idle machine
@pytest.mark.parametrize("held_ahead", [False, True])
async def test_a_governed_fire_is_admitted_ahead_and_published_at_its_due_time(
        held_ahead: bool) -> None:
    """The overlap gate's reservation is made ADMIT_AHEAD_S before the due time, the
    publish at it (never before); a fire paused between the two is skipped at its due time
    and its reservation withdrawn. A fire the gate held ahead (its key's run still open)
    is published at its due time through the gate, and had no reservation to withdraw."""
    start = dt.datetime.now(dt.UTC)
    due = start + dt.timedelta(seconds=0.6)
    entries = {s: Entry(1, False, Interval(60.0, T0), 0.0, "all", 3600.0, "t",
                        overlap="skip") for s in ("kept", "paused")}
    skipped: list[str] = []

    class PausedOnceAdmitted(NotedPublisher):
        async def admit(self, claims: list[Claim], term: Fenced
                        ) -> tuple[list[Claim], list[Claim]]:
            await super().admit(claims, term)
            # The schedule is paused once its fire was admitted (the mirror's change
            # reaches the publisher: ``forget`` counts it).
            entries["paused"] = entries["paused"].replace(paused=True)
            self.changes += 1
            return (claims, []) if not held_ahead else ([], claims)

    class Ledger:
        async def skip(self, ids: list[str], term: int, reason: str) -> None:
            skipped.extend(ids)

    publisher = PausedOnceAdmitted()
    dispatcher, lease = publishing_dispatcher(entries, publisher, Ledger())
    claims = [Claim(f"{s}@x", s, due, due) for s in ("kept", "paused")]
    async with Term(1, lease, entries) as term:  # type: ignore[arg-type]
        term.add_pending(claims)
        await dispatcher.firing.publish_when_due(claims, {"kept": 1, "paused": 1}, term)
        assert term.next_publish_at() is None
        assert not term.pending
    # Each claim's publish span is prepared ahead, the admitted fires rendered at their
    # admission, and both discarded once settled. Held ones hold no reservation to
    # withdraw, and are rendered when published. A fire held ahead (its run still open
    # then) goes through the gate at its due time; a schedule changed since the claims
    # were checked, so none is published as unchanged.
    events = publisher.events
    assert [(what, ids) for what, ids, _ in events] == [
        ("prepare", ["kept@x", "paused@x"]), ("admit", ["kept@x", "paused@x"]),
        ("ready", [] if held_ahead else ["kept@x", "paused@x"]),
        *([] if held_ahead else [("unadmit", ["paused@x"])]),
        ("publish", ["kept@x"]), ("discard", ["kept@x", "paused@x"])]
    assert publisher.published == [(["kept@x"], not held_ahead, False)]
    admitted_at, published_at = events[1][2], events[-2][2]
    ahead = dt.timedelta(seconds=ADMIT_AHEAD_S)
    assert due - ahead <= admitted_at < due
    assert published_at >= due
    assert skipped == ["paused@x"]


async def test_claims_overlap_up_to_their_bound_and_the_watermark_waits_for_all() -> None:
    """A round's claim batches await the database CLAIMS_IN_FLIGHT at a time (never more,
    and more than one when there are several), every one is made before the watermark
    moves, and one that loses the lease ends the loop with LeadershipLost, the other in
    flight cancelled or finished, none left running."""
    now = dt.datetime.now(dt.UTC)
    entries = {f"s{i:05d}": Entry(1, False, Interval(3600.0, now), 0.0, "all", 3600.0, "t")
               for i in range(5 * CLAIM_BATCH)}
    lease = SimpleNamespace(valid=True, term=1)
    dispatcher = Dispatcher(SimpleNamespace(entries=entries), None, None, None,  # type: ignore[arg-type]
                            lease, clock=lambda: now)  # type: ignore[arg-type]
    term = dispatcher.term = await Term(1, lease, entries).__aenter__()  # type: ignore[arg-type]
    await dispatcher._seed(term, now - dt.timedelta(seconds=1))
    at_once = most = 0
    claimed: list[int] = []
    watermark_at_claims: list[dt.datetime | None] = []
    fail_batch: int | None = None
    running: list[asyncio.Task[None] | None] = []
    batches = len(entries) // CLAIM_BATCH
    overlapped, third_started = asyncio.Event(), asyncio.Event()

    async def claim(batch: list[Due], term_: Term, now_: dt.datetime,
                    *args: object, **kwargs: object) -> tuple[int, int]:
        nonlocal at_once, most
        at_once += 1
        most = max(most, at_once)
        started = len(running)
        running.append(asyncio.current_task())  # type: ignore[arg-type]
        try:
            if fail_batch is None:
                # Each round trip lasts until as many as may be are in flight (or this is
                # the last batch): with a bound of one, that is at once.
                if at_once >= CLAIMS_IN_FLIGHT or started == batches - 1:
                    overlapped.set()
                await overlapped.wait()
            elif started == fail_batch + 1:  # in flight when the other loses the lease
                third_started.set()
                await asyncio.Event().wait()  # until cancelled
            elif started == fail_batch:
                await third_started.wait()
                raise LeadershipLost
            claimed.append(len(batch))
            watermark_at_claims.append(term_.watermark)
            return len(batch), len(batch)
        finally:
            at_once -= 1

    dispatcher.firing.claim_and_publish = claim  # type: ignore[method-assign]
    loop = asyncio.create_task(dispatcher._fire_loop(term))
    await wait_until(lambda: term.watermark is not None, 10, "the round's watermark")
    assert sum(claimed) == len(entries)
    assert watermark_at_claims == [None] * len(claimed)  # all made before it moved
    assert 1 < most <= CLAIMS_IN_FLIGHT
    lease.valid = False
    with pytest.raises(LeadershipLost):
        await asyncio.wait_for(loop, 10)

    # A round whose second claim loses the lease.
    lease.valid, claimed[:], running[:] = True, [], []
    fail_batch = 1
    term.watermark = None
    for schedule_id in entries:
        dispatcher.on_change(schedule_id, entries[schedule_id].replace(revision=2))
    await dispatcher._seed(term, now - dt.timedelta(seconds=1))
    with pytest.raises(LeadershipLost):
        await asyncio.wait_for(dispatcher._fire_loop(term), 10)
    assert term.watermark is None
    assert len(running) == 3
    assert all(task is not None and task.done() for task in running)
    left_in_flight = running[2]
    assert left_in_flight is not None
    assert left_in_flight.cancelled()


async def test_fires_spread_over_the_second_are_claimed_in_rounds_not_one_by_one() -> None:
    """A schedule due every millisecond of the second (1,000 phases): the loop claims what
    falls within CLAIM_AHEAD_S at most once every CLAIM_EVERY_S on the clock, never
    later than that round's lag behind the horizon (a round per fire, thousands a second,
    made an insert and its round trip each)."""
    now = dt.datetime.now(dt.UTC)
    # The first fires 2 s away: every round, the first one too, claims ahead.
    base = now.replace(microsecond=0) + dt.timedelta(seconds=2)
    entries = {f"s{i:04d}": Entry(1, False, Interval(1.0, base + dt.timedelta(milliseconds=i)),
                                  0.0, "all", 3600.0, "t") for i in range(1000)}
    lease = SimpleNamespace(valid=True, term=1)
    dispatcher = Dispatcher(SimpleNamespace(entries=entries), None, None, None,  # type: ignore[arg-type]
                            lease)  # type: ignore[arg-type]
    term = dispatcher.term = await Term(1, lease, entries).__aenter__()  # type: ignore[arg-type]
    await dispatcher._seed(term, now)
    rounds: list[tuple[dt.datetime, dt.datetime]] = []  # (claimed at, earliest due)

    async def claim(batch: list[Due], term_: Term, now_: dt.datetime,
                    *args: object, **kwargs: object) -> tuple[int, int]:
        rounds.append((dt.datetime.now(dt.UTC), min(d.fire_at for d in batch)))
        return len(batch), len(batch)

    dispatcher.firing.claim_and_publish = claim  # type: ignore[method-assign]
    loop = asyncio.create_task(dispatcher._fire_loop(term))
    try:
        first = await wait_until(lambda: rounds[0][0] if rounds else None, 10, "a round")
        await wait_until(lambda: rounds[-1][0] - first > dt.timedelta(seconds=0.5), 10,
                         "half a second of rounds")
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    span_s = (rounds[-1][0] - first).total_seconds()
    # 500-odd fires fell due for claiming meanwhile: a round each would be hundreds.
    assert len(rounds) <= span_s / CLAIM_EVERY_S + 3, (len(rounds), span_s)
    # Every round claims ahead: at most a round short of CLAIM_AHEAD_S, and a busy
    # machine's lag (up to a second allowed: the suite runs beside other processes).
    for claimed_at, due in rounds:
        assert (due - claimed_at).total_seconds() > CLAIM_AHEAD_S - CLAIM_EVERY_S - 1.0



class AckingBroker:
    """Acknowledges every message, noting its fire id."""

    def __init__(self, sent: list[str]) -> None:
        self.sent = sent

    async def publish(self, messages: list[Any], timeout_s: float
                      ) -> list[BaseException | None]:
        self.sent.extend(m.fire_id for m in messages)
        return [None] * len(messages)


class OneSchedule:
    """The stored schedules: "s" alone."""

    async def find(self, query: dict[str, Any], projection: Any = None
                   ) -> AsyncIterator[dict[str, Any]]:
        yield {"_id": "s", "name": "s", "target": "t.x", "payload": {}, "revision": 1}

async def test_a_retry_turn_publishes_each_fire_once_and_its_batches_side_by_side() -> None:
    """A turn of the retry loop reads the claimed fires due for a retry with one cursor and
    publishes each batch as it is read, a second while the first awaits the broker (a new
    leader's adopted claims, thousands, went out one batch after another). Its marks are
    written behind the publishes: the turn ends once they are, so the next turn takes
    none of them again."""
    now = dt.datetime.now(dt.UTC)
    due = [Claim(f"s@{i}", "s", now - dt.timedelta(seconds=60), now - dt.timedelta(seconds=60))
           for i in range(3 * CLAIM_BATCH + 10)]
    state = {c.fire_id: "claimed" for c in due}
    sent: list[str] = []
    side_by_side = asyncio.Event()

    class Ledger:
        async def due_for_retry(self, term: int, at: dt.datetime, limit: int, batch: int
                                ) -> AsyncIterator[list[Claim]]:
            read = [c for c in due if state[c.fire_id] == "claimed"][:limit]
            for i in range(0, len(read), batch):
                yield read[i:i + batch]

        async def mark_published_many(
                self, marks: list[tuple[list[str], int, dt.datetime, int]]) -> None:
            for _ in range(3):  # the round trip: other tasks run meanwhile
                await asyncio.sleep(0)
            for fire_ids, *_ in marks:
                state.update(dict.fromkeys(fire_ids, "published"))

    class TwoAtOnce(AckingBroker):
        """The first publish is acknowledged once a second one is under way."""
        publishing = 0

        async def publish(self, messages: list[Any], timeout_s: float
                          ) -> list[BaseException | None]:
            self.publishing += 1
            if self.publishing == 2:
                side_by_side.set()
            await side_by_side.wait()
            return await super().publish(messages, timeout_s)

    entries = {"s": Entry(1, False, Interval(60.0, now), 0.0, "all", 3600.0, "t.x")}
    dispatcher = Dispatcher(SimpleNamespace(entries=entries), OneSchedule(), Ledger(),  # type: ignore[arg-type]
                            TwoAtOnce(sent), SimpleNamespace(valid=True))  # type: ignore[arg-type]
    term = await Term(1, SimpleNamespace(valid=True, term=1), entries).__aenter__()  # type: ignore[arg-type]
    await asyncio.wait_for(dispatcher.takeover.retry_due(term), 10)
    assert sorted(sent) == sorted(c.fire_id for c in due)  # each once
    assert set(state.values()) == {"published"}
    await dispatcher.takeover.retry_due(term)  # type: ignore[arg-type]
    assert len(sent) == len(due)


async def test_a_handover_waits_for_the_marks_of_its_publishes() -> None:
    """The drain lets the marks written behind the last publishes land (within the drain
    timeout): a fire left claimed would be republished by the next leader."""
    now = dt.datetime.now(dt.UTC)
    written = asyncio.Event()
    gate = asyncio.Event()

    class Ledger:
        async def mark_published_many(
                self, marks: list[tuple[list[str], int, dt.datetime, int]]) -> None:
            await gate.wait()
            written.set()

    entries = {"s": Entry(1, False, Interval(60.0, now), 0.0, "all", 3600.0, "t.x")}
    lease = SimpleNamespace(valid=True, term=1)
    dispatcher = Dispatcher(SimpleNamespace(entries=entries), OneSchedule(), Ledger(),  # type: ignore[arg-type]
                            AckingBroker([]), lease)  # type: ignore[arg-type]
    dispatcher.term = await Term(1, lease, entries).__aenter__()  # type: ignore[arg-type]
    await dispatcher.publisher.publish([Claim("s@1", "s", now, now)], dispatcher.term,
                                       attempt=1)
    drained = asyncio.create_task(dispatcher.drain())
    await still_pending(drained, 0.2, "the drain while its mark is written")
    gate.set()
    await asyncio.wait_for(drained, 5)
    assert written.is_set()


@pytest.fixture
async def fresh_db(mongo_uri: str) -> AsyncIterator[Any]:
    """A database of its own on the development server."""
    import uuid

    from pymongo import AsyncMongoClient

    from tests.servers import with_database

    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        with_database(mongo_uri, f"dispatch_{uuid.uuid4().hex[:8]}"), tz_aware=True)
    try:
        yield client.get_default_database()
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def leading(db: Any, fires: Any, entries: dict[str, Entry], broker: Any,
                  fired_through: dt.datetime) -> AsyncIterator[Dispatcher]:
    """A dispatcher leading term 2 over ``entries`` (stored as schedules), its predecessor's
    watermark ``fired_through``; stopped on the way out."""
    from hascheduler.storage.lease import LeaseView

    await fires.ensure_indexes(3600)
    await db.schedules.insert_many([{"_id": sid, "name": sid, "target": "t.x", "payload": {},
                                     "revision": 1} for sid in entries])
    lease = SimpleNamespace(valid=True, term=2, remaining=lambda: 5.0,
                            timings=SimpleNamespace(ttl=1.0))
    dispatcher = Dispatcher(SimpleNamespace(entries=entries), db.schedules, fires,
                            broker, lease)
    now = dt.datetime.now(dt.UTC)
    view = LeaseView("b", 2, now + dt.timedelta(seconds=1), fired_through=fired_through)
    lead = asyncio.create_task(dispatcher.lead(view))
    try:
        yield dispatcher
    finally:
        lead.cancel()
        await asyncio.gather(lead, return_exceptions=True)


async def test_a_successor_reads_the_ledger_before_claiming_what_its_predecessor_fired(
        fresh_db: Any) -> None:
    """Against the development server: a new leader's catch-up starts where the lease's
    watermark was last written, up to a fifth of a second and more before its
    predecessor stopped, so it meets fires that predecessor published. It reads the ledger
    for them rather than inserting claims the unique index refuses (each refusal cost the
    database ten times the read: a second's 10,000 fires held the first new fire back half
    a second), publishes none of them again, and goes on firing."""
    from hascheduler.storage import fires as ledger

    db = fresh_db
    recorded = InsertsNoted(db.fires)
    now = dt.datetime.now(dt.UTC)
    base = now.replace(microsecond=0) - dt.timedelta(seconds=10)
    entries = {"s": Entry(1, False, Interval(1.0, base), 0.0, "all", 3600.0, "t.x")}
    # The predecessor (term 1) published every fire due by now.
    fired = [base + dt.timedelta(seconds=k) for k in range(11)
             if base + dt.timedelta(seconds=k) <= now]
    for nominal in fired:
        doc = ledger.claim_document("s", nominal, nominal, 1, nominal)
        doc["state"] = ledger.PUBLISHED
        await db.fires.insert_one(doc)
    predecessors = {fire_id("s", nominal) for nominal in fired}
    sent: list[str] = []
    async with leading(db, ledger.Ledger(recorded), entries,  # type: ignore[arg-type]
                       AckingBroker(sent), now - dt.timedelta(seconds=3)):
        await wait_until(lambda: sent, 10, "the successor's first fire")
    assert not predecessors & set(sent)
    assert not predecessors & set(recorded.inserted)
    assert set(sent) <= set(recorded.inserted)  # its own fires: claimed, then published


class AdoptionsNoted:
    """The ledger, noting the fire ids of each adoption in turn."""

    def __init__(self, ledger: Any) -> None:
        self.ledger = ledger
        self.adoptions: list[list[str]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ledger, name)

    async def adopt(self, fire_ids: set[str], term: int, now: dt.datetime) -> set[str]:
        taken: set[str] = await self.ledger.adopt(fire_ids, term, now)
        self.adoptions.append(sorted(fire_ids))
        return taken


async def test_a_successor_republishes_its_predecessors_latest_claims_first(
        fresh_db: Any) -> None:
    """Against the development server: a dead leader's claims due by the takeover are
    adopted and republished a batch at a time, latest due first. It published in due
    order, so its earlier claims are mostly published (duplicates to the broker) and its
    latest the likeliest not: behind 10,000 duplicates they came a third of a second
    later. Every one is published."""
    from hascheduler.storage import fires as ledger

    db = fresh_db
    now = dt.datetime.now(dt.UTC)
    entries = {"s": Entry(1, False, Interval(3600.0, now), 0.0, "all", 3600.0, "t.x")}
    # Inserted oldest first, as the dead leader claimed them: the order a plain read of
    # the collection returns.
    due = [now - dt.timedelta(milliseconds=k) for k in range(2 * CLAIM_BATCH + 500, 0, -1)]
    await db.fires.insert_many([ledger.claim_document("s", d, d, 1, d - dt.timedelta(
        seconds=1)) for d in due])
    sent: list[str] = []
    fires = AdoptionsNoted(ledger.Ledger(db.fires))
    async with leading(db, fires, entries, AckingBroker(sent), now):
        await wait_until(lambda: len(sent) >= len(due), 20, "the adopted claims' publishes")
    latest_first = [fire_id("s", d) for d in reversed(due)]
    batches = [latest_first[i:i + CLAIM_BATCH] for i in range(0, len(due), CLAIM_BATCH)]
    assert fires.adoptions == [sorted(batch) for batch in batches]
    assert sorted(sent) == sorted(latest_first)


async def test_a_backlog_past_the_takeovers_bound_is_taken_by_the_retry_loop(
        fresh_db: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against the development server: a takeover reads at most a turn of retries' worth
    of the claims left (a sorted read of an hour's backlog would be millions of
    documents); the retry loop adopts and publishes the rest, an older term's and this
    term's previous lead's alike."""
    from hascheduler.replica import takeover
    from hascheduler.storage import fires as ledger

    monkeypatch.setattr(takeover, "RETRY_BATCHES_PER_TURN", 1)
    db = fresh_db
    now = dt.datetime.now(dt.UTC)
    entries = {"s": Entry(1, False, Interval(3600.0, now), 0.0, "all", 3600.0, "t.x")}
    due = [now - dt.timedelta(milliseconds=k) for k in range(1, 2 * CLAIM_BATCH + 301)]
    # The oldest 300 were claimed by this term's previous lead, the rest by term 1.
    await db.fires.insert_many([ledger.claim_document(
        "s", d, d, 2 if i >= 2 * CLAIM_BATCH else 1, d - dt.timedelta(seconds=3))
        for i, d in enumerate(due)])
    sent: list[str] = []
    fires = AdoptionsNoted(ledger.Ledger(db.fires))
    async with leading(db, fires, entries, AckingBroker(sent), now):
        await wait_until(lambda: len(set(sent)) >= len(due), 20,
                         "every claim left published")

        async def none_claimed() -> bool:
            return await db.fires.count_documents({"state": ledger.CLAIMED}) == 0

        await wait_until(none_claimed, 10, "every claim marked published")
    # The takeover adopted the latest batch alone; the retry loop the rest.
    assert fires.adoptions == [sorted(fire_id("s", d) for d in due[:CLAIM_BATCH])]
    assert set(sent) == {fire_id("s", d) for d in due}


async def test_a_takeover_fires_what_falls_due_beside_republishing_what_fell_due_before(
        fresh_db: Any) -> None:
    """Against the development server: a new leader's first fires are not held behind its
    predecessor's claims being republished (10,000 of them took the first new fire a
    second past its due time), and until that republish and the catch-up after it end,
    the lease keeps the predecessor's watermark, so a leader after this one catches up
    from there."""
    from hascheduler.storage import fires as ledger

    db = fresh_db
    now = dt.datetime.now(dt.UTC)
    # "new" falls due 0.3 s into the term; "old" never again, but its predecessor's claim,
    # due a second ago, awaits its republish.
    entries = {"new": Entry(1, False, Interval(3600.0, now + dt.timedelta(seconds=0.3)),
                            0.0, "all", 3600.0, "t.x"),
               "old": Entry(1, False, Interval(3600.0, now - dt.timedelta(seconds=1)),
                            0.0, "all", 3600.0, "t.x")}
    left = now - dt.timedelta(seconds=1)
    await db.fires.insert_one(ledger.claim_document("old", left, left, 1,
                                                    left - dt.timedelta(seconds=1)))
    republish = asyncio.Event()
    sent: list[str] = []

    class HeldRepublish(AckingBroker):
        async def publish(self, messages: list[Any], timeout_s: float
                          ) -> list[BaseException | None]:
            if any(m.fire_id == fire_id("old", left) for m in messages):
                await republish.wait()
            return await super().publish(messages, timeout_s)

    since = now - dt.timedelta(seconds=2)
    async with leading(db, ledger.Ledger(db.fires), entries, HeldRepublish(sent),
                       since) as dispatcher:
        await wait_until(lambda: sent, 5, "the new fire beside the held republish")
        assert sent == [fire_id("new", now + dt.timedelta(seconds=0.3))]
        assert dispatcher.fired_through == since
        republish.set()
        await wait_until(lambda: dispatcher.fired_through not in (None, since), 5,
                         "the watermark moving once the take-over ended")
        assert fire_id("old", left) in sent


class SlowLedger:
    """A ledger each of whose calls takes 0.6 s (a round trip and a new connection on a
    slow link)."""

    async def claimed(self, fire_ids: list[str]) -> set[str]:
        await asyncio.sleep(0.6)
        return set()

    async def claim(self, docs: list[dict[str, Any]]) -> set[str]:
        await asyncio.sleep(0.6)
        return set()


async def test_a_contested_claims_read_and_insert_each_get_what_remains_of_the_term() -> None:
    """Near the start of a term a claim reads the ledger first, then inserts: the insert
    within what remains of the term when it starts (1 s here, the lease renewed
    meanwhile), not within what remained when the read began, which their 1.2 s together
    would outlast (the leader stopped firing over a slowed link: test_slow_link.py)."""
    lease = SimpleNamespace(valid=True, term=2, remaining=lambda: 1.0,
                            timings=SimpleNamespace(ttl=2.0))
    dispatcher = Dispatcher(SimpleNamespace(entries={}), None,  # type: ignore[arg-type]
                            SlowLedger(), None, lease,  # type: ignore[arg-type]
                            clock=lambda: at(9.99))
    term = await Term(2, lease, {}).__aenter__()  # type: ignore[arg-type]
    term.contest_until(at(10))
    mine = [Claim("s@10", "s", at(10), at(10))]
    assert await dispatcher.firing.claim(mine, term, at(9.99)) == mine


class RenewedLease:
    """A held lease of term 1 whose renew deadline, while it is renewed, lies ``budget_s``
    past each time the term asks what remains (the elector's renewals, as the term sees
    them); after ``lapse`` it ends ``budget_s`` past the last ask. ``asks`` counts them.
    Its ttl is ``ttl_s``."""

    def __init__(self, budget_s: float, ttl_s: float) -> None:
        self.term = 1
        self.budget_s = budget_s
        self.timings = SimpleNamespace(ttl=ttl_s)
        self.renewed = True
        self.asks = 0
        self.until = asyncio.get_running_loop().time() + budget_s

    def remaining(self) -> float:
        now = asyncio.get_running_loop().time()
        self.asks += 1
        if self.renewed:
            self.until = now + self.budget_s
        return max(0.0, self.until - now)

    @property
    def valid(self) -> bool:
        return self.renewed or self.until > asyncio.get_running_loop().time()


async def test_a_terms_read_lasts_while_the_lease_is_renewed_and_ends_when_it_lapses() -> None:
    """A read that decides a write changes nothing: it goes on past what remained of the
    term when it began for as long as the lease is renewed (with that fixed budget, a pool
    the database held up stopped the fire loop), and is abandoned when the renewals stop,
    once the last one's time runs out and not before."""
    loop = asyncio.get_running_loop()
    lease = RenewedLease(0.2, ttl_s=10.0)
    answer = asyncio.Event()

    async def read() -> str:
        await answer.wait()
        return "read"

    async with Term(1, lease, {}) as term:  # type: ignore[arg-type]
        reading = asyncio.create_task(term.read(read()))
        # The term looks again each time what remained runs out: four looks past its
        # first budget, the read goes on.
        await wait_until(lambda: lease.asks >= 5, 10, "four renewed budgets")
        assert not reading.done()
        answer.set()
        assert await asyncio.wait_for(reading, 5) == "read"

        answer.clear()
        reading = asyncio.create_task(term.read(read()))
        await wait_until(lambda: lease.asks >= 6, 5, "the second read's first ask")
        lease.renewed = False
        with pytest.raises(LeadershipLost):
            await asyncio.wait_for(reading, 5)
        # Not before the last renewal's time ran out (measured from that renewal, not from
        # when this test woke to stop renewing: its poll lags by up to an interval).
        assert loop.time() >= lease.until - 0.01


async def test_a_terms_read_ends_when_a_newer_term_holds_the_lease_or_after_three_ttls(
        ) -> None:
    """Renewed or not, a read ends with LeadershipLost when the lease is another term's
    (re-elected meanwhile), and when it outlasts three lease ttls (a connection gone
    silent, which the driver would wait on for ever)."""
    loop = asyncio.get_running_loop()
    lease = RenewedLease(0.2, ttl_s=10.0)
    async with Term(1, lease, {}) as term:  # type: ignore[arg-type]
        reading = asyncio.create_task(term.read(asyncio.Event().wait()))
        lease.term = 2
        with pytest.raises(LeadershipLost):
            await asyncio.wait_for(reading, 5)

    lease = RenewedLease(0.2, ttl_s=0.5)
    async with Term(1, lease, {}) as term:  # type: ignore[arg-type]
        began = loop.time()
        with pytest.raises(LeadershipLost):
            await asyncio.wait_for(term.read(asyncio.Event().wait()), 10)
        assert loop.time() - began >= 3 * 0.5 - 0.05
        assert lease.asks > 3  # renewed all along: the bound, not the lease, ended it


async def test_a_deferrable_write_that_outlasts_the_term_is_put_off_while_the_term_holds(
        ) -> None:
    """``write_or_defer`` (the retry loop's periodic adoption): past what remains of the
    term, a write returns None while the term still holds the lease, so the lead goes on
    and makes it again next turn; the write is still one ``settle`` waits for. Once the
    term no longer holds, it raises LeadershipLost, as ``write`` does."""
    lease = SimpleNamespace(valid=True, term=1, remaining=lambda: 0.2,
                            timings=SimpleNamespace(ttl=2.0))
    answer = asyncio.Event()

    async def adopt() -> int:
        await answer.wait()
        return 3

    async with Term(1, lease, {}) as term:  # type: ignore[arg-type]
        assert await asyncio.wait_for(term.write_or_defer(adopt()), 5) is None
        assert len(term._writes.tasks) == 1  # in flight: settle waits for it
        lease.valid = False
        with pytest.raises(LeadershipLost):
            await asyncio.wait_for(term.write_or_defer(adopt()), 5)
        answer.set()
        assert await term.settle(5)
        lease.valid = True
        assert await asyncio.wait_for(term.write_or_defer(adopt()), 5) == 3
