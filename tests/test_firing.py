"""The firing path (replica/firing.py): claims, their adoption when due, the overlap
gate's admission ahead of the due time, the last look at the due time, and publishing
(replica/publishing.py: backoff, ticks, an unavailable broker)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from hascheduler.brokers.base import BrokerUnavailable
from hascheduler.core.claims import Claim, none_withdrawn, withdrawn
from hascheduler.core.entries import Entry
from hascheduler.core.triggers import Interval, fire_id
from hascheduler.replica.dispatch import Dispatcher
from hascheduler.replica.firing import (
    ADMIT_AHEAD_S,
    PUBLISH_TICK_S,
    FiringPath,
    publish_tick,
)
from hascheduler.replica.overlap import Fenced
from hascheduler.replica.publishing import DispatchSettings, backoff_s
from hascheduler.replica.term import LeadershipLost, Term
from hascheduler.storage.fire_counts import FireCounts
from hascheduler.storage.fire_records import CLAIMED, PUBLISHED, claim_document
from hascheduler.storage.fires import Ledger
from tests.dispatching import (
    T0,
    AckingBroker,
    ClaimsNoted,
    FixedLease,
    Mirrored,
    NotedPublisher,
    SlowLedger,
    at,
    bare_dispatcher,
    firing_path,
    stores_over,
    unreachable_db,
)
from tests.servers import with_database


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


async def test_an_unavailable_broker_is_waited_out_and_a_refusal_is_not() -> None:
    """BrokerUnavailable is retried past the attempt limit, with a short backoff, until
    max_unavailable_s past the due time; a refusal fails at the attempt limit."""
    now = dt.datetime.now(dt.UTC)
    recorded: list[tuple[str, str, float | None]] = []

    class Recorded(Ledger):
        async def mark_failed(
            self, fire_id: str, term: int, attempt: int, error: str, at: dt.datetime
        ) -> None:
            recorded.append((fire_id, "failed", None))

        async def retry_later(
            self, fire_id: str, term: int, attempt: int, error: str, at: dt.datetime
        ) -> None:
            recorded.append((fire_id, "retry", (at - now).total_seconds()))

    class Uncounted(FireCounts):  # no schedule here has max_fires
        async def release(self, schedule_id: str, fire_id: str) -> None:
            pass

    settings = DispatchSettings(
        max_attempts=3, unavailable_backoff_cap_s=2.0, max_unavailable_s=300.0
    )
    db = unreachable_db()
    stores = dataclasses.replace(
        stores_over(db, Recorded(db.fires)), counts=Uncounted(db.fire_counts)
    )
    dispatcher = Dispatcher(
        Mirrored({}), stores, AckingBroker([]), FixedLease(), settings, clock=lambda: now
    )

    def claim(fire: str, due: dt.datetime) -> Claim:
        return Claim(fire, "s", due, due)

    recent = claim("recent", now - dt.timedelta(seconds=10))
    old = claim("old", now - dt.timedelta(seconds=301))
    publisher = dispatcher.publisher
    for attempt in range(1, 8):
        await publisher.record_failure(recent, 1, attempt, BrokerUnavailable("down"))
    await publisher.record_failure(old, 1, 3, BrokerUnavailable("down"))
    await publisher.record_failure(claim("refused", recent.due_at), 1, 3, RuntimeError("refused"))
    waits = [wait for fire, what, wait in recorded if fire == "recent"]
    assert len(waits) == 7
    assert all(wait is not None and 0 <= wait <= 2.0 for wait in waits), waits
    assert ("old", "failed", None) in recorded
    assert ("refused", "failed", None) in recorded


@pytest.mark.parametrize("contested", [False, True])
async def test_a_claim_taken_by_a_deposed_leader_is_adopted_when_it_falls_due(
    mongo_uri: str, contested: bool
) -> None:
    """Against the development server: a duplicate key on claiming means another claim;
    only an unpublished one from an older term is taken over (with our term), never a
    published one, a newer term's, or one this replica is already publishing. The same
    when the fires are due while a term before may have claimed them (``contested``): the
    ledger is read first, and only the fire not in it is inserted."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        with_database(mongo_uri, f"adopt_{uuid.uuid4().hex[:8]}"), tz_aware=True
    )
    try:
        db = client.get_default_database()
        fires = db.fires
        now = at(10)
        lease = FixedLease(term=2, remaining_s=5.0, ttl_s=10.0)
        dispatcher = Dispatcher(
            Mirrored({}),
            stores_over(db, recorded := ClaimsNoted(fires)),
            AckingBroker([]),
            lease,
            clock=lambda: now,
        )
        term = await Term(2, lease, {}).__aenter__()
        if contested:
            term.contest_until(at(10))

        def claim(sid: str, term: int) -> dict[str, Any]:
            return claim_document(sid, at(10), at(10), term, at(9.99))

        deposed, published, newer, ours = (
            claim("deposed", 1),
            claim("published", 1),
            claim("newer", 3),
            claim("ours", 2),
        )
        published["state"] = PUBLISHED
        await fires.insert_many([deposed, published, newer, ours])
        term.add_pending([Claim(str(ours["_id"]), "ours", at(10), at(10))])

        mine = [
            Claim(fire_id(sid, at(10)), sid, at(10), at(10))
            for sid in ("deposed", "published", "newer", "ours", "fresh")
        ]
        owned = await dispatcher.firing.claim(mine, term, at(9.99))

        assert sorted(c.fire_id for c in owned) == [
            fire_id("deposed", at(10)),
            fire_id("fresh", at(10)),
        ]
        stored = {d["schedule_id"]: d async for d in fires.find({})}
        assert (stored["deposed"]["term"], stored["deposed"]["claimed_at"]) == (2, now)
        assert stored["deposed"]["state"] == CLAIMED
        assert (stored["published"]["term"], stored["published"]["state"]) == (1, "published")
        assert stored["newer"]["term"] == 3
        assert stored["ours"]["claimed_at"] == at(9.99)  # untouched: already ours, in flight
        assert stored["fresh"]["term"] == 2
        assert recorded.inserted == ([mine[-1].fire_id] if contested else [c.fire_id for c in mine])
    finally:
        await client.close()


def test_claims_none_withdrawn_are_those_still_due_would_keep_all_of() -> None:
    """The check made ahead (none_withdrawn) says yes only where the one at the due time
    (still_due, through withdrawn) keeps every claim."""
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    every = Interval(1.0, now - dt.timedelta(seconds=60))
    entries = {
        "s": Entry(1, False, every, 0.0, "all", 3600.0, "t.x"),
        "changed": Entry(2, False, every, 0.0, "all", 3600.0, "t.x"),
        "moved": Entry(
            2, False, Interval(1.0, now - dt.timedelta(seconds=59.5)), 0.0, "all", 3600.0, "t.x"
        ),
        "paused": Entry(1, True, every, 0.0, "all", 3600.0, "t.x"),
        "until": Entry(
            1, True, every, 0.0, "all", 3600.0, "t.x", paused_until=now + dt.timedelta(seconds=5)
        ),
        "completed": Entry(1, False, every, 0.0, "all", 3600.0, "t.x", completed=True),
    }
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


async def test_claims_unchanged_since_their_check_are_published_without_another() -> None:
    """Nothing changed (the publisher's count of changes) between the check made once the
    claims are in and their due time: they are published as they are, no look at each
    then (_still_due), and the publisher takes their templates as rendered."""
    due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=0.4)
    entries = {s: Entry(1, False, Interval(60.0, T0), 0.0, "all", 3600.0, "t") for s in ("a", "b")}
    publisher = NotedPublisher()

    class NotAskedAgain(FiringPath):
        async def still_due(
            self, due: list[Claim], revisions: dict[str, int], term: Term
        ) -> list[Claim]:
            raise AssertionError("checked again at the due time")

    firing = firing_path(NotAskedAgain, entries, publisher)
    claims = [Claim(f"{s}@x", s, due, due) for s in ("a", "b")]
    async with Term(1, FixedLease(), entries) as term:
        term.add_pending(claims)
        await firing.publish_when_due(claims, {"a": 1, "b": 1}, term)
    assert publisher.published == [(["a@x", "b@x"], True, True)]


async def test_claims_whose_admission_runs_out_of_the_terms_time_are_left_to_its_retries() -> None:
    """The gate's reservation, ahead of the due time, outlasts what remains of the term (a
    database stepping down) and the term goes on: its claims are no longer this publish's,
    and the term's retries take them (they passed over a claim still pending, so it stayed
    claimed, never published)."""
    due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=0.3)
    entries = {"s": Entry(1, False, Interval(60.0, T0), 0.0, "all", 3600.0, "t", overlap="skip")}

    class OutOfTime(NotedPublisher):
        async def admit(self, claims: list[Claim], term: Fenced) -> tuple[list[Claim], list[Claim]]:
            raise LeadershipLost

    firing = firing_path(FiringPath, entries, OutOfTime())
    claims = [Claim("s@x", "s", due, due)]
    async with Term(1, FixedLease(), entries) as term:
        term.add_pending(claims)
        with pytest.raises(LeadershipLost):
            await firing.publish_when_due(claims, {"s": 1}, term)
        assert not term.pending
        assert term.next_publish_at() is None


@pytest.mark.alone  # times the admission against the real clock: on an idle machine
@pytest.mark.parametrize("held_ahead", [False, True])
async def test_a_governed_fire_is_admitted_ahead_and_published_at_its_due_time(
    held_ahead: bool,
) -> None:
    """The overlap gate's reservation is made ADMIT_AHEAD_S before the due time, the
    publish at it (never before); a fire paused between the two is skipped at its due time
    and its reservation withdrawn. A fire the gate held ahead (its key's run still open)
    is published at its due time through the gate, and had no reservation to withdraw."""
    start = dt.datetime.now(dt.UTC)
    due = start + dt.timedelta(seconds=0.6)
    entries = {
        s: Entry(1, False, Interval(60.0, T0), 0.0, "all", 3600.0, "t", overlap="skip")
        for s in ("kept", "paused")
    }
    skipped: list[str] = []

    class PausedOnceAdmitted(NotedPublisher):
        async def admit(self, claims: list[Claim], term: Fenced) -> tuple[list[Claim], list[Claim]]:
            await super().admit(claims, term)
            # The schedule is paused once its fire was admitted (the mirror's change
            # reaches the publisher: ``forget`` counts it).
            entries["paused"] = entries["paused"].replace(paused=True)
            self.changes += 1
            return (claims, []) if not held_ahead else ([], claims)

    class Skips(Ledger):
        async def skip(self, ids: list[str], term: int, reason: str) -> None:
            skipped.extend(ids)

    publisher = PausedOnceAdmitted()
    firing = firing_path(FiringPath, entries, publisher, Skips(unreachable_db().fires))
    claims = [Claim(f"{s}@x", s, due, due) for s in ("kept", "paused")]
    async with Term(1, FixedLease(), entries) as term:
        term.add_pending(claims)
        await firing.publish_when_due(claims, {"kept": 1, "paused": 1}, term)
        assert term.next_publish_at() is None
        assert not term.pending
    # Each claim's publish span is prepared ahead, the admitted fires rendered at their
    # admission, and both discarded once settled. Held ones hold no reservation to
    # withdraw, and are rendered when published. A fire held ahead (its run still open
    # then) goes through the gate at its due time; a schedule changed since the claims
    # were checked, so none is published as unchanged.
    events = publisher.events
    assert [(what, ids) for what, ids, _ in events] == [
        ("prepare", ["kept@x", "paused@x"]),
        ("admit", ["kept@x", "paused@x"]),
        ("ready", [] if held_ahead else ["kept@x", "paused@x"]),
        *([] if held_ahead else [("unadmit", ["paused@x"])]),
        ("publish", ["kept@x"]),
        ("discard", ["kept@x", "paused@x"]),
    ]
    assert publisher.published == [(["kept@x"], not held_ahead, False)]
    admitted_at, published_at = events[1][2], events[-2][2]
    ahead = dt.timedelta(seconds=ADMIT_AHEAD_S)
    assert due - ahead <= admitted_at < due
    assert published_at >= due
    assert skipped == ["paused@x"]


async def test_a_contested_claims_read_and_insert_each_get_what_remains_of_the_term() -> None:
    """Near the start of a term a claim reads the ledger first, then inserts: the insert
    within what remains of the term when it starts (1 s here, the lease renewed
    meanwhile), not within what remained when the read began, which their 1.2 s together
    would outlast (the leader stopped firing over a slowed link: test_slow_link.py)."""
    lease = FixedLease(term=2, remaining_s=1.0, ttl_s=2.0)
    dispatcher = bare_dispatcher({}, lease, SlowLedger(), clock=lambda: at(9.99))
    term = await Term(2, lease, {}).__aenter__()
    term.contest_until(at(10))
    mine = [Claim("s@10", "s", at(10), at(10))]
    assert await dispatcher.firing.claim(mine, term, at(9.99)) == mine
