"""The dispatcher: retry backoff, seeding that lets the loop run, and taking over a deposed
leader's claim (against the development server)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
from typing import Any

import pytest
import structlog.testing

from hascheduler.core.catchup import (
    LATE_CHANGE_S,
    LATE_FIRES_MAX,
    late_fires,
    plan_catchups,
    replan_from,
)
from hascheduler.core.claims import Claim
from hascheduler.core.entries import Entry, Written
from hascheduler.core.fanout import FanOut
from hascheduler.core.fire_queue import SEED_STEP, Due
from hascheduler.core.triggers import At, Interval
from hascheduler.replica.backfilling import BACKFILL_QUIET_S, Backfilling
from hascheduler.replica.dispatch import CLAIM_EVERY_S, Dispatcher
from hascheduler.replica.firing import (
    CLAIM_AHEAD_S,
    CLAIM_BATCH,
    CLAIMS_IN_FLIGHT,
    FiringPath,
)
from hascheduler.replica.term import LeadershipLost, Term
from hascheduler.storage.backfills import Backfills
from hascheduler.storage.fires import Ledger
from tests.dispatching import (
    T0,
    AckingBroker,
    FixedLease,
    Mirrored,
    OneSchedule,
    at,
    bare_dispatcher,
    changes_applied,
    firing_as,
    stores_over,
    unreachable_db,
)
from tests.waiting import still_pending, wait_until


async def test_seeding_lets_the_loop_run_and_a_change_meanwhile_is_queued() -> None:
    def entry(revision: int, every_s: float = 60.0) -> Entry:
        return Entry(revision, False, Interval(every_s, T0), 0.0, "all", 3600.0, "t")

    entries = {f"s{i:05d}": entry(1) for i in range(3 * SEED_STEP)}
    lease = FixedLease()
    dispatcher = bare_dispatcher(entries, lease)
    term = dispatcher.term = await Term(1, lease, entries).__aenter__()
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
    await dispatcher._seed(term, at(0.25), {})
    seeded = True
    await other
    assert turns >= 2, "the seed never let another task run"
    queued = {(d.revision, d.nominal) for d in term.queue.items() if d.schedule_id == "s00000"}
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
    lease = FixedLease()
    dispatcher = bare_dispatcher({"f": entry}, lease, clock=lambda: now, sources=Sources())
    term = dispatcher.term = await Term(1, lease, {"f": entry}).__aenter__()
    term.advance(now)
    claimed: list[Claim] = []

    class ClaimsNoted(FiringPath):
        async def claim(
            self, claims: list[Claim], term: Term, now: dt.datetime, backfill: str | None = None
        ) -> list[Claim]:
            claimed.extend(claims)
            return []  # nothing to publish in this test

    firing_as(dispatcher, ClaimsNoted)
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
            for schedule_id, at, written in [
                ("late", w - second, made(w - 2 * second)),
                ("loaded", w - second, None),
                ("lost", w - 2 * late, made(w - 3 * late)),
            ]:
                entries[schedule_id] = one_off(at)
                dispatcher.on_change(schedule_id, entries[schedule_id], written)
        # Only the change past the bound, whose fire is lost, is said to be late.
        assert [(e["event"], e["schedule_id"]) for e in logged if e["log_level"] == "warning"] == [
            ("change_applied_late", "lost")
        ]
        assert [(d.schedule_id, d.fire_at) for d in term.queue.items()] == [("late", w - second)]
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
    entries = {"new": Entry(1, False, Interval(1.0, T0 - 60 * second), 0.0, "all", 3600.0, "t")}
    async with changes_applied(entries, w) as (dispatcher, term):
        dispatcher.on_change("new", entries["new"], Written(T0 + 12 * ms, T0 + 10 * ms))
        assert [d.nominal for d in term.queue.items()] == [T0 + second]


async def test_a_change_applied_while_a_term_starts_fires_what_fell_due_before_it() -> None:
    """The mirror applies a new schedule (its write held up) while a term starts, before
    the term has a watermark: the term's seed plans it from the term's start, and, the
    catch-up having read creation times before it was committed, nothing planned its
    instants between its creation and the start. The change is kept with its times, and
    once seeded those instants are claimed (late_fires), as a late change's are."""
    second = dt.timedelta(seconds=1)
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    every = Interval(1.0, now - 60 * second)
    entries = {
        "new": Entry(1, False, every, 0.0, "all", 3600.0, "t.x"),
        "changed": Entry(2, False, every, 0.0, "all", 3600.0, "t.x"),
        "paused": Entry(1, True, every, 0.0, "all", 3600.0, "t.x"),
        "fan-out": Entry(
            1, False, every, 0.0, "all", 3600.0, "t.x", fan_out=FanOut(collection="tenants")
        ),
    }
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
            ("fan-out", now - 2 * second),
            ("new", now - 2 * second),
            ("changed", now - second),
            ("fan-out", now - second),
            ("new", now - second),
            ("changed", now),
            ("fan-out", now),
            ("new", now),
        ]
        # Made after the term's start, or more than LATE_CHANGE_S before it: from the
        # start, or from LATE_CHANGE_S back.
        assert late_fires({"new": Written(now + second, now + second)}, entries, now) == []
        far = late_fires({"new": Written(now, now - 60 * second)}, entries, now)
        assert len(far) == LATE_CHANGE_S
        # Valid but expensive: a trigger every half millisecond makes 20,000 fires in
        # those 10 s; at most LATE_FIRES_MAX are planned, in both late paths.
        dense = {
            "dense": Entry(1, False, Interval(0.0005, now - 60 * second), 0.0, "all", 3600.0, "t.x")
        }
        assert (
            len(late_fires({"dense": Written(now, now - 60 * second)}, dense, now))
            == LATE_FIRES_MAX
        )
        caught, _ = plan_catchups(
            list(dense.items()), now, now, {"dense": now - LATE_CHANGE_S * second}
        )
        assert len(caught) == LATE_FIRES_MAX  # the late ones; after the watermark, none due


async def test_a_backfill_is_worked_only_in_the_quiet_between_regular_fires() -> None:
    """A backfill's chunk waits while a regular publish or claim is due within
    BACKFILL_QUIET_S, so its claims and publishes never land in front of a cron's
    second; with nothing due soon, it goes."""
    now = T0 + dt.timedelta(seconds=59)  # the schedule fires every minute from T0
    entries = {"s": Entry(1, False, Interval(60.0, T0), 0.0, "all", 3600.0, "t")}
    lease = FixedLease()
    dispatcher = bare_dispatcher(entries, lease, clock=lambda: now)
    quiet = dt.timedelta(seconds=BACKFILL_QUIET_S)
    db = unreachable_db()
    backfilling = Backfilling(
        Backfills(db.backfills),
        Ledger(db.fires),
        entries,
        dispatcher.firing.claim_and_publish,
        lambda: False,
        lambda: now,
        CLAIM_AHEAD_S,
    )
    async with Term(1, lease, entries) as term:
        assert backfilling.quiet(term)  # nothing due at all
        soon, later = now + quiet / 2, now + quiet * 2
        first, second, third = (
            Claim(f"f{i}", "s", due, due) for i, due in enumerate((soon, soon, later))
        )
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
        list(term.queue.seed(now, {}, {}))
        assert term.queue.first_at() == now + dt.timedelta(seconds=1)
        assert dt.timedelta(seconds=1 - CLAIM_AHEAD_S) < quiet
        assert not backfilling.quiet(term)
        term.queue.clear()
        list(term.queue.seed(now + dt.timedelta(seconds=2), {}, {}))
        assert term.queue.first_at() == now + dt.timedelta(seconds=61)
        assert backfilling.quiet(term)
        term.queue.clear()
        term.remove_pending([third])
        assert term.next_publish_at() is None
        assert term.pending == {}
        assert backfilling.quiet(term)


async def test_claims_overlap_up_to_their_bound_and_the_watermark_waits_for_all() -> None:
    """A round's claim batches await the database CLAIMS_IN_FLIGHT at a time (never more,
    and more than one when there are several), every one is made before the watermark
    moves, and one that loses the lease ends the loop with LeadershipLost, the other in
    flight cancelled or finished, none left running."""
    now = dt.datetime.now(dt.UTC)
    entries = {
        f"s{i:05d}": Entry(1, False, Interval(3600.0, now), 0.0, "all", 3600.0, "t")
        for i in range(5 * CLAIM_BATCH)
    }
    lease = FixedLease()
    dispatcher = bare_dispatcher(entries, lease, clock=lambda: now)
    term = dispatcher.term = await Term(1, lease, entries).__aenter__()
    await dispatcher._seed(term, now - dt.timedelta(seconds=1), {})
    at_once = most = 0
    claimed: list[int] = []
    watermark_at_claims: list[dt.datetime | None] = []
    fail_batch: int | None = None
    running: list[asyncio.Task[Any] | None] = []
    batches = len(entries) // CLAIM_BATCH
    overlapped, third_started = asyncio.Event(), asyncio.Event()

    class Batches(FiringPath):
        async def claim_and_publish(
            self,
            batch: list[Due],
            term: Term,
            now: dt.datetime,
            may_defer: bool = True,
            overlap: str | None = None,
            backfill: str | None = None,
            published: list[asyncio.Task[None]] | None = None,
        ) -> tuple[int, int]:
            return await claim(batch, term)

    async def claim(batch: list[Due], term_: Term) -> tuple[int, int]:
        nonlocal at_once, most
        at_once += 1
        most = max(most, at_once)
        started = len(running)
        running.append(asyncio.current_task())
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

    firing_as(dispatcher, Batches)
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
    await dispatcher._seed(term, now - dt.timedelta(seconds=1), {})
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
    entries = {
        f"s{i:04d}": Entry(
            1, False, Interval(1.0, base + dt.timedelta(milliseconds=i)), 0.0, "all", 3600.0, "t"
        )
        for i in range(1000)
    }
    lease = FixedLease()
    dispatcher = bare_dispatcher(entries, lease)
    term = dispatcher.term = await Term(1, lease, entries).__aenter__()
    await dispatcher._seed(term, now, {})
    rounds: list[tuple[dt.datetime, dt.datetime]] = []  # (claimed at, earliest due)

    class Rounds(FiringPath):
        async def claim_and_publish(
            self,
            batch: list[Due],
            term: Term,
            now: dt.datetime,
            may_defer: bool = True,
            overlap: str | None = None,
            backfill: str | None = None,
            published: list[asyncio.Task[None]] | None = None,
        ) -> tuple[int, int]:
            rounds.append((dt.datetime.now(dt.UTC), min(d.fire_at for d in batch)))
            return len(batch), len(batch)

    firing_as(dispatcher, Rounds)
    loop = asyncio.create_task(dispatcher._fire_loop(term))
    try:
        first: dt.datetime = await wait_until(
            lambda: rounds[0][0] if rounds else None, 10, "a round"
        )
        await wait_until(
            lambda: rounds[-1][0] - first > dt.timedelta(seconds=0.5), 10, "half a second of rounds"
        )
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


async def test_a_handover_waits_for_the_marks_of_its_publishes() -> None:
    """The drain lets the marks written behind the last publishes land (within the drain
    timeout): a fire left claimed would be republished by the next leader."""
    now = dt.datetime.now(dt.UTC)
    written = asyncio.Event()
    gate = asyncio.Event()

    class MarksWaiting(Ledger):
        async def mark_published_many(
            self, marks: list[tuple[list[str], int, dt.datetime, int]]
        ) -> None:
            await gate.wait()
            written.set()

    entries = {"s": Entry(1, False, Interval(60.0, now), 0.0, "all", 3600.0, "t.x")}
    lease = FixedLease()
    db = unreachable_db()
    stores = dataclasses.replace(stores_over(db, MarksWaiting(db.fires)), store=OneSchedule())
    dispatcher = Dispatcher(Mirrored(entries), stores, AckingBroker([]), lease)
    dispatcher.term = await Term(1, lease, entries).__aenter__()
    await dispatcher.publisher.publish([Claim("s@1", "s", now, now)], dispatcher.term, attempt=1)
    drained = asyncio.create_task(dispatcher.drain())
    await still_pending(drained, 0.2, "the drain while its mark is written")
    gate.set()
    await asyncio.wait_for(drained, 5)
    assert written.is_set()
