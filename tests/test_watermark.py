"""The one rule of the watermark a lease records (Term.fired_through, invariant 5): an
instant falls behind it only once it is claimed or recorded skipped. One test per path
that takes an instant off the queue, each with a fault at its worst moment (no database,
no broker: the dispatcher's claim is a fake that fails or holds as the test says)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from hascheduler.core.catchup import plan_catchups
from hascheduler.core.claims import Claim
from hascheduler.core.entries import Entry, Written
from hascheduler.core.fanout import FanOut
from hascheduler.core.fire_queue import Due
from hascheduler.core.triggers import At, Interval, jitter_offset
from hascheduler.replica.dispatch import Dispatcher
from hascheduler.replica.firing import FiringPath
from hascheduler.replica.overlap import Fenced
from hascheduler.replica.publishing import Publisher
from hascheduler.replica.term import LeadershipLost, Term
from hascheduler.storage.fires import Ledger
from tests.dispatching import FixedLease, bare_dispatcher, firing_as, unreachable_db
from tests.waiting import wait_until

SECOND = dt.timedelta(seconds=1)

Claiming = Callable[[list[Claim], Term, dt.datetime, str | None], Awaitable[list[Claim]]]


def claiming_with(dispatcher: Dispatcher, claim: Claiming) -> None:
    """``dispatcher``'s firing path claims through ``claim`` (a fake that fails or holds
    as the test says), the rest of the path as it is."""

    class Through(FiringPath):
        async def claim(
            self, claims: list[Claim], term: Term, now: dt.datetime, backfill: str | None = None
        ) -> list[Claim]:
            return await claim(claims, term, now, backfill)

    firing_as(dispatcher, Through)


class Sources:
    """A fan-out source whose mirror is loading until ``in_sync`` is set."""

    def __init__(self) -> None:
        self.in_sync = asyncio.Event()

    def tenants(self, wanted: FanOut) -> list[str] | None:
        return ["a", "b"] if self.in_sync.is_set() else None

    async def wait_ready(self, wanted: FanOut, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.in_sync.wait(), timeout_s)
        return self.in_sync.is_set()


@contextlib.asynccontextmanager
async def leading(
    entries: dict[str, Entry],
    now: dt.datetime,
    sources: Sources | None = None,
    quota: Callable[[str], float | None] = lambda namespace: None,
    ledger: Ledger | None = None,
) -> AsyncIterator[tuple[Dispatcher, Term, FixedLease]]:
    """A dispatcher leading term 1 over ``entries`` at ``now`` (its clock), the term's
    watermark at ``now``, its fire ledger ``ledger`` when one is given; yields it, the
    term and the fake lease."""
    lease = FixedLease()
    dispatcher = bare_dispatcher(
        entries, lease, ledger, clock=lambda: now, sources=sources, quota=quota
    )
    async with Term(1, lease, entries) as term:
        dispatcher.term = term
        term.advance(now)
        yield dispatcher, term, lease


def fan_out_entry(start: dt.datetime) -> Entry:
    return Entry(
        1,
        False,
        Interval(60.0, start),
        0.0,
        "all",
        3600.0,
        "t",
        FanOut.model_validate({"collection": "tenants"}),
    )


async def test_a_deferred_fan_out_fire_whose_claim_fails_while_the_term_goes_on_is_kept() -> None:
    """The fire waits for its source; when the source is in sync its claim's write outlasts
    what remained of the term (LeadershipLost), but the lease is renewed and the term goes
    on. On 19ca195 the fire was dropped there and the watermark moved past it; now it
    stays open, goes back into the queue and is claimed for every tenant."""
    now = dt.datetime.now(dt.UTC)
    sources = Sources()
    entries = {"f": fan_out_entry(now)}
    async with leading(entries, now, sources) as (dispatcher, term, _):
        claimed: list[Claim] = []
        failures = 1

        async def claim(
            claims: list[Claim], term_: Term, now_: dt.datetime, backfill: str | None = None
        ) -> list[Claim]:
            nonlocal failures
            if failures:
                failures -= 1
                raise LeadershipLost  # the write outlasted the term; renewed meanwhile
            claimed.extend(claims)
            return []

        claiming_with(dispatcher, claim)
        due = Due(now + SECOND, now + SECOND, "f", 1)
        await dispatcher.firing.claim_and_publish([due], term, now)
        assert term.fired_through is not None
        assert term.fired_through < due.fire_at
        sources.in_sync.set()
        # The claim failed: the instant went back into the queue, still held.
        await wait_until(lambda: failures == 0 and not term.deferred, 5, "the failed claim")
        term.advance(now + 3 * SECOND)  # the loop's own watermark moves on meanwhile
        fired_through = term.fired_through
        assert fired_through is not None
        assert fired_through < due.fire_at, fired_through
        loop = asyncio.create_task(dispatcher._fire_loop(term))
        try:
            await wait_until(lambda: len(claimed) == 2, 5, "the fire claimed again")
            await wait_until(lambda: not term.open, 5, "the instant resolved")
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
        assert sorted(c.tenant or "" for c in claimed) == ["a", "b"]
        assert term.fired_through == term.watermark


async def test_a_term_that_ends_before_its_deferred_fire_is_claimed_records_it_unhandled() -> None:
    """The term ends (its lease lost) while a fan-out fire waits for its source: what the
    term says it fired through, as it ends and after, stays before that fire, so the next
    leader's catch-up covers it."""
    now = dt.datetime.now(dt.UTC)
    sources = Sources()
    async with leading({"f": fan_out_entry(now)}, now, sources) as (dispatcher, term, lease):
        due = Due(now + SECOND, now + SECOND, "f", 1)
        await dispatcher.firing.claim_and_publish([due], term, now)
        term.advance(now + 3 * SECOND)  # the loop moved on meanwhile
        lease.valid = False
    # Left: the wait cancelled, the instant still open (fixed as the term ended).
    assert not term.active
    assert term.fired_through is not None
    assert term.fired_through < due.fire_at
    assert (due.schedule_id, due.nominal) in term.open
    # Even were the source in sync now, a term that ended claims nothing.
    sources.in_sync.set()
    assert term.fired_through < due.fire_at


async def test_a_batch_whose_claim_is_in_flight_holds_the_watermark() -> None:
    """A batch taken off the queue is open until its claim is answered: a renewal made
    meanwhile records a watermark before it, even for an instant before the loop's
    watermark (a late change's), and a claim that loses the lease leaves it open."""
    now = dt.datetime.now(dt.UTC)
    late = now - 2 * SECOND  # queued by a change applied late
    entries = {"one": Entry(1, False, At((late,)), 0.0, "all", 3600.0, "t")}
    async with leading(entries, now) as (dispatcher, term, _):
        term.queue.defer(Due(late, late, "one", 1), late)
        assert term.fired_through == late - dt.timedelta(microseconds=1)
        answer: asyncio.Future[list[Claim]] = asyncio.get_running_loop().create_future()
        asked = asyncio.Event()

        async def claim(
            claims: list[Claim], term_: Term, now_: dt.datetime, backfill: str | None = None
        ) -> list[Claim]:
            asked.set()
            return await answer

        claiming_with(dispatcher, claim)
        loop = asyncio.create_task(dispatcher._fire_loop(term))
        await asyncio.wait_for(asked.wait(), 5)
        assert term.queue.first_at() is None  # off the queue, its claim in flight
        assert term.fired_through == late - dt.timedelta(microseconds=1)
        answer.set_exception(LeadershipLost())
        with pytest.raises(LeadershipLost):
            await asyncio.wait_for(loop, 5)
        assert term.fired_through == late - dt.timedelta(microseconds=1)


async def test_late_fires_planned_at_a_terms_start_hold_the_watermark_until_claimed() -> None:
    """The fires of changes applied while a term started are open from the moment they are
    planned, before the task that claims them runs."""
    now = dt.datetime.now(dt.UTC)
    async with leading({}, now) as (_, term, _lease):
        due = Due(now - SECOND, now - SECOND, "late", 1)
        term.opened([due])
        assert term.fired_through == due.fire_at - dt.timedelta(microseconds=1)
        term.resolved([due])
        assert term.fired_through == now


async def test_a_fire_a_quota_puts_off_holds_the_watermark_at_its_slot() -> None:
    """A namespace's quota gives a fire a later slot: it goes back into the queue, and the
    watermark stays before that slot until it is claimed."""
    now = dt.datetime.now(dt.UTC)
    entries = {
        f"s{i}": Entry(1, False, At((now + SECOND,)), 0.0, "all", 3600.0, "t") for i in range(5)
    }
    async with leading(entries, now, quota=lambda namespace: 1.0) as (dispatcher, term, _):
        batch = [Due(now + SECOND, now + SECOND, sid, 1) for sid in entries]
        term.opened(batch)
        admitted = await dispatcher.quotas.admit(batch, term, now)
        assert 0 < len(admitted) < len(batch)
        put_off = [d for d in batch if d not in admitted]
        first_slot = term.queue.first_at()
        assert first_slot is not None
        assert first_slot > now + SECOND
        # The admitted ones are still open (their claim is next); the others are queued.
        assert {(d.schedule_id, d.nominal) for d in admitted} == set(term.open)
        term.resolved(admitted)
        assert term.fired_through == now
        term.advance(first_slot + SECOND)  # the loop's watermark passes the slot
        assert term.fired_through == first_slot - dt.timedelta(microseconds=1)
        assert len(put_off) == len(batch) - len(admitted)


def test_a_catch_up_plans_a_schedule_paused_until_an_instant_from_that_instant() -> None:
    """The successor's mirror still shows the schedule paused until an instant now past
    (the resume not yet written): its catch-up fires every instant from ``until`` on, by
    its policy; on 19ca195 it passed the schedule over, and the resume it wrote later was
    planned from its commit, so the instants in between were never fired."""
    since = dt.datetime.now(dt.UTC).replace(microsecond=0)
    until = since + 2.5 * SECOND
    now = since + 6 * SECOND
    entry = Entry(1, True, Interval(1.0, since), 0.0, "all", 3600.0, "t", paused_until=until)
    fire, skipped = plan_catchups([("p", entry)], since, now, {})
    assert [d.nominal for d in fire] == [since + k * SECOND for k in (3, 4, 5, 6)]
    assert skipped == []
    # Created in the seconds before the watermark: its late instants skip the pause too.
    fire, _ = plan_catchups([("p", entry)], since + 4 * SECOND, now, {"p": since})
    assert [d.nominal for d in fire] == [since + k * SECOND for k in (3, 4, 5, 6)]


async def test_a_resume_applied_after_its_until_fires_from_the_until() -> None:
    """Paused until U; the resume (written by the leader once U passed, or by hand) is
    applied with the loop's watermark already past U (a slow change stream, a busy
    server): the schedule fires from U, not from the resume's commit. On 19ca195 the
    instants between were dropped from the queue as paused and never planned again (the
    chaos soak: two instants of a schedule resumed during a leader kill, never claimed).
    A U before the term's start is left to the catch-up."""
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    until = now - 2.5 * SECOND
    paused = Entry(
        1, True, Interval(1.0, now - 60 * SECOND), 0.0, "all", 3600.0, "t", paused_until=until
    )
    entries = {"p": paused}
    async with leading(entries, now) as (dispatcher, term, _):
        dispatcher.on_change("p", paused)  # the pause, as the mirror applied it
        entries["p"] = paused.replace(revision=2, paused=False, paused_until=None)
        dispatcher.on_change("p", entries["p"], Written(now, None))  # the resume, late
        queued = sorted(d.nominal for d in term.queue.items() if d.revision == 2)
        assert queued[0] == now - 2 * SECOND
    async with leading(dict(entries), now) as (dispatcher, term, _):
        term.started_at = now - SECOND
        entries["p"] = paused
        dispatcher.on_change("p", paused)
        entries["p"] = paused.replace(revision=2, paused=False, paused_until=None)
        dispatcher.on_change("p", entries["p"], Written(now, None))
        queued = sorted(d.nominal for d in term.queue.items() if d.revision == 2)
        assert queued[0] == now


def test_a_catch_up_fires_what_fell_due_before_a_pause_began() -> None:
    """The leader died; during the outage the schedule was paused (at P, until U, or for
    good): its instants between the previous leader's watermark and P were due, and are
    fired by its policy; those from P to U are not (the pause is their record); those from
    U on are. The chaos soak: an instant due 3 ms before a pause, its leader SIGSTOPped,
    was planned by no one."""
    since = dt.datetime.now(dt.UTC).replace(microsecond=0)
    now = since + 10 * SECOND
    paused = Entry(
        1,
        True,
        Interval(1.0, since),
        0.0,
        "all",
        3600.0,
        "t",
        paused_since=since + 3.5 * SECOND,
        paused_until=since + 6.5 * SECOND,
    )
    fire, skipped = plan_catchups([("p", paused)], since, now, {})
    assert [d.nominal for d in fire] == [since + k * SECOND for k in (1, 2, 3, 7, 8, 9, 10)]
    assert skipped == []
    for_good = paused.replace(paused_until=None)
    fire, _ = plan_catchups([("p", for_good)], since, now, {})
    assert [d.nominal for d in fire] == [since + k * SECOND for k in (1, 2, 3)]
    # With catch-up `latest`: the latest of each span it is not paused in.
    latest = paused.replace(catchup="latest")
    fire, skipped = plan_catchups([("p", latest)], since, now, {})
    assert [d.nominal for d in fire] == [since + 3 * SECOND, since + 10 * SECOND]
    assert [(r.first, r.last, r.count) for _, r in skipped] == [
        (since + SECOND, since + 2 * SECOND, 2),
        (since + 7 * SECOND, since + 9 * SECOND, 3),
    ]
    # At its due time, an instant before the pause began is not withdrawn by it.
    assert not paused.paused_at(since + 3 * SECOND)
    assert paused.paused_at(since + 4 * SECOND)
    assert not paused.paused_at(since + 7 * SECOND)


async def test_a_fan_outs_late_instant_the_ledger_holds_is_left_to_what_was_claimed() -> None:
    """A catch-up's fan-out instants before the watermark the previous leader passed:
    one the ledger holds any tenant's claim of was handled then (for the tenants selected
    then) and is left out, resolved; one it holds nothing of is claimed for the tenants
    selected now; one after the watermark is claimed whatever the ledger holds (a partly
    claimed instant gets its missing tenants)."""
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    sources = Sources()
    sources.in_sync.set()
    entries = {"f": fan_out_entry(now - 60 * SECOND)}
    handled, unhandled, after = (now - 3 * SECOND, now - 2 * SECOND, now - SECOND)

    class Held(Ledger):
        async def instants_held(
            self, schedule_id: str, nominals: list[dt.datetime]
        ) -> set[dt.datetime]:
            return {n for n in nominals if n in (handled, after)}

    held = Held(unreachable_db().fires)
    async with leading(entries, now, sources, ledger=held) as (dispatcher, term, _):
        claimed: list[Claim] = []

        async def claim(
            claims: list[Claim], term_: Term, now_: dt.datetime, backfill: str | None = None
        ) -> list[Claim]:
            claimed.extend(claims)
            return []

        claiming_with(dispatcher, claim)
        dues = [Due(n, n, "f", 1) for n in (handled, unhandled, after)]
        await dispatcher.firing.claim_late(dues, term, now, passed=now - 1.5 * SECOND)
        assert sorted({c.nominal_at for c in claimed}) == [unhandled, after]
        assert {c.tenant for c in claimed} == {"a", "b"}
        assert term.open == {}


def test_a_jittered_catch_up_counts_no_instant_its_predecessor_handled() -> None:
    """Planned from the watermark less the jitter, a skipped range counted again the
    instants whose jittered time was by the watermark (fired or recorded skipped by the
    previous leader: 4 said, 3 missed); now each is counted once."""
    w = dt.datetime.now(dt.UTC).replace(microsecond=0)
    while jitter_offset("j", w - SECOND, 1.5) > SECOND:  # one instant handled, at least
        w += SECOND
    now = w + 5 * SECOND
    entry = Entry(1, False, Interval(1.0, w - 60 * SECOND), 1.5, "none", 3600.0, "t")
    nominals = [w + k * SECOND for k in range(-1, 6)]  # (w - 1.5 s, now]
    handled = [n for n in nominals if n + jitter_offset("j", n, 1.5) <= w]
    assert handled
    _, skipped = plan_catchups([("j", entry)], w, now, {})
    assert len(skipped) == 1
    skip = skipped[0][1]
    assert skip.count == len(nominals) - len(handled)
    assert skip.first == next(n for n in nominals if n not in handled)
    assert skip.last == now


async def test_a_lead_that_ended_acts_no_more_when_its_term_is_led_again() -> None:
    """A replica stops firing (its renewal late past the deadline) and, the renewal then
    made, leads the same term again: the lead before must not act beside the new one (its
    publishing tasks decided on fires the new lead adopted). Only a handover's drain keeps
    the ended lead acting while the lease holds."""
    lease = FixedLease(term=7, remaining_s=5.0)
    async with Term(7, lease, {}) as old:
        assert old.holds
    assert not old.holds  # the lease is valid and still term 7's: led anew, not by it
    async with Term(7, lease, {}) as draining:
        draining.handing_over.set()  # Dispatcher.hand_over, before its lead is cancelled
    assert draining.holds
    lease.valid = False
    assert not draining.holds


async def test_a_new_schedule_learned_of_past_the_bound_records_what_it_could_not_fire() -> None:
    """A new schedule whose insert reached the leader 30 s after its creation (past
    LATE_CHANGE_S) is planned from the bound; the instants between its creation and the
    bound are recorded skipped, saying why, not left to a log line. A changed schedule's
    are not (the leader fired them as it stood)."""
    w = dt.datetime.now(dt.UTC).replace(microsecond=0)
    every = Entry(1, False, Interval(1.0, w - 60 * SECOND), 0.0, "all", 3600.0, "t")
    entries = {"new": every, "changed": every.replace(revision=2)}
    recorded: list[dict[str, Any]] = []

    class Recorded(Ledger):
        async def record_skipped(self, docs: list[dict[str, Any]]) -> None:
            recorded.extend(docs)

    ledger = Recorded(unreachable_db().fires)
    async with leading(entries, w, ledger=ledger) as (dispatcher, _term, _):
        dispatcher.on_change("new", every, Written(w, w - 30 * SECOND))
        dispatcher.on_change("changed", entries["changed"], Written(w - 30 * SECOND, None))
        await wait_until(lambda: recorded, 5, "the skipped range recorded")
    assert [
        (d["schedule_id"], d["nominal_at"], d["last_nominal_at"], d["count"]) for d in recorded
    ] == [("new", w - 29 * SECOND, w - 10 * SECOND, 20)]
    assert "30 s late" in recorded[0]["reason"]


async def test_a_claim_the_term_is_publishing_is_not_republished_beside_it() -> None:
    """A retry turn or a takeover's republish reads a claim this term is publishing
    already (taken over at its due time by a catch-up's claim, or its publish in flight):
    it is left to that publish. Published twice at once, the two passed the overlap gate
    apart, one reserving its run and the other recording it skipped, and the fire buffered
    behind that run waited for ever (the chaos soak, seed 2)."""
    now = dt.datetime.now(dt.UTC)
    async with leading({}, now) as (dispatcher, term, _):
        in_flight, left = (Claim(f"s@{i}", "s", now, now) for i in range(2))
        term.add_pending([in_flight])
        published: list[str] = []

        class Noted(Publisher):
            async def publish(self, claims: list[Claim], term: Fenced, attempt: int) -> None:
                published.extend(c.fire_id for c in claims)

            async def marked(self) -> None:
                return None

        own = dispatcher.publisher
        dispatcher.takeover.publisher = Noted(
            own.broker,
            own.ledger,
            own.mirror,
            own.store,
            own.gate,
            own.counts,
            own.settings,
            own.clock,
            own.metrics,
        )

        async def batches() -> AsyncGenerator[list[Claim]]:
            yield [in_flight, left]

        await dispatcher.takeover.republish(term, batches())
        assert published == [left.fire_id]
        assert set(term.pending) == {in_flight.fire_id}  # the republished one settled
