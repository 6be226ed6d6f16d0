"""What the tests of the leader's work share: fakes of its parts and a leading dispatcher
over the development server."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pymongo import AsyncMongoClient
from pymongo.asynchronous.database import AsyncDatabase

from hascheduler.brokers.base import Broker
from hascheduler.core.claims import Claim
from hascheduler.core.entries import Entry
from hascheduler.core.events import FireMessage
from hascheduler.process.metrics import Metrics
from hascheduler.replica.dispatch import Dispatcher, LeaderStores
from hascheduler.replica.firing import FiringPath, Publishing
from hascheduler.replica.overlap import Fenced
from hascheduler.replica.publishing import DispatchSettings
from hascheduler.replica.term import HeldLease, Term
from hascheduler.storage.backfills import Backfills
from hascheduler.storage.collection import Collection
from hascheduler.storage.fire_counts import FireCounts
from hascheduler.storage.fires import Ledger
from hascheduler.storage.lease import LeaseTimings, LeaseView
from hascheduler.storage.runs import RunLedger
from hascheduler.storage.schedules import ScheduleStore

FiringKind = TypeVar("FiringKind", bound=FiringPath)

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def at(minutes: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


@dataclass
class Mirrored:
    """The mirror as the leader's work reads it: the entries by schedule id."""

    entries: dict[str, Entry]


@dataclass
class FixedLease:
    """A held lease as a term sees it, its answers fixed (a test may change them)."""

    term: int = 1
    remaining_s: float = 5.0
    ttl_s: float = 10.0
    valid: bool = True

    @property
    def timings(self) -> LeaseTimings:
        return LeaseTimings(self.ttl_s, 0.7 * self.ttl_s, 0.2 * self.ttl_s)

    def remaining(self) -> float:
        return self.remaining_s


def unreachable_db() -> AsyncDatabase[dict[str, Any]]:
    """A database no server answers: a part built over it for a test that never asks it
    anything fails at once if it does."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        "mongodb://127.0.0.1:1", connect=False, serverSelectionTimeoutMS=100
    )
    return client.get_database("unreachable")


def stores_over(db: AsyncDatabase[dict[str, Any]], ledger: Ledger | None = None) -> LeaderStores:
    """The leader's stores over ``db`` (its fire ledger ``ledger`` when one is given)."""
    return LeaderStores(
        ledger or Ledger(db.fires),
        RunLedger(db.runs),
        ScheduleStore(db.schedules),
        FireCounts(db.fire_counts),
        Backfills(db.backfills),
    )


def bare_dispatcher(
    entries: dict[str, Entry],
    lease: HeldLease,
    ledger: Ledger | None = None,
    broker: Broker | None = None,
    **options: Any,
) -> Dispatcher:
    """A dispatcher over ``entries`` whose database no server answers (its fire ledger
    ``ledger`` when one is given) and whose broker acknowledges every message: for what
    its queue, its loop and its fakes do."""
    return Dispatcher(
        Mirrored(entries),
        stores_over(unreachable_db(), ledger),
        broker or AckingBroker([]),
        lease,
        **options,
    )


def firing_as(dispatcher: Dispatcher, kind: type[FiringKind]) -> FiringKind:
    """``dispatcher`` firing through a ``kind`` of firing path (a test's subclass), built
    as its own was; the term's services that fire go through it too."""
    old = dispatcher.firing
    firing = kind(
        old.entries,
        old.ledger,
        old.publisher,
        old.settings,
        old.clock,
        old.metrics,
        old.sources,
        old.wake,
    )
    dispatcher.firing = dispatcher.quotas.firing = dispatcher.requests.firing = firing
    dispatcher.takeover.firing = firing
    return firing


@contextlib.asynccontextmanager
async def changes_applied(
    entries: dict[str, Entry], watermark: dt.datetime | None
) -> AsyncIterator[tuple[Dispatcher, Term]]:
    """A dispatcher over ``entries`` leading a term whose loop has got to ``watermark``
    (no database, no broker: for what a change queues)."""
    lease = FixedLease()
    dispatcher = bare_dispatcher(entries, lease)
    async with Term(1, lease, entries) as term:
        dispatcher.term = term
        if watermark is not None:
            term.advance(watermark)
        yield dispatcher, term


class ClaimsNoted(Ledger):
    """The fire ledger, noting the id of every claim it is asked to insert."""

    def __init__(self, fires: Collection) -> None:
        super().__init__(fires)
        self.inserted: list[str] = []

    async def claim(self, docs: list[dict[str, Any]]) -> set[str]:
        self.inserted.extend(str(d["_id"]) for d in docs)
        return await super().claim(docs)


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

    async def admit(self, claims: list[Claim], term: Fenced) -> tuple[list[Claim], list[Claim]]:
        self._note("admit", claims)
        return claims, []

    def ready(self, claims: list[Claim], term: int) -> None:
        self._note("ready", claims)

    async def unadmit(self, claims: list[Claim], term: int) -> None:
        self._note("unadmit", claims)

    async def publish(self, claims: list[Claim], term: Fenced, attempt: int) -> None:
        self._note("publish", claims)
        self.published.append(([c.fire_id for c in claims], False, False))

    async def publish_admitted(self, claims: list[Claim], term: Fenced, unchanged: bool) -> None:
        self._note("publish", claims)
        self.published.append(([c.fire_id for c in claims], True, unchanged))


def firing_path(
    kind: type[FiringKind],
    entries: dict[str, Entry],
    publisher: Publishing,
    ledger: Ledger | None = None,
) -> FiringKind:
    """A ``kind`` of firing path over ``entries``, publishing through ``publisher``."""
    return kind(
        entries,
        ledger or Ledger(unreachable_db().fires),
        publisher,
        DispatchSettings(),
        lambda: dt.datetime.now(dt.UTC),
        Metrics(),
        None,
        lambda: None,
    )


class AckingBroker:
    """Acknowledges every message, noting its fire id."""

    def __init__(self, sent: list[str]) -> None:
        self.sent = sent

    async def start(self) -> None:
        pass

    async def publish(
        self, messages: Sequence[FireMessage], timeout_s: float
    ) -> list[BaseException | None]:
        self.sent.extend(m.fire_id for m in messages)
        return [None] * len(messages)

    async def close(self) -> None:
        pass


class OneSchedule(ScheduleStore):
    """The stored schedules: "s" alone."""

    def __init__(self) -> None:
        super().__init__(unreachable_db().schedules)

    async def message_fields(self, ids: list[str]) -> list[dict[str, Any]]:
        return [{"_id": "s", "name": "s", "target": "t.x", "payload": {}, "revision": 1}]


@contextlib.asynccontextmanager
async def leading(
    db: AsyncDatabase[dict[str, Any]],
    fires: Ledger,
    entries: dict[str, Entry],
    broker: Broker,
    fired_through: dt.datetime,
) -> AsyncIterator[Dispatcher]:
    """A dispatcher leading term 2 over ``entries`` (stored as schedules), its predecessor's
    watermark ``fired_through``; stopped on the way out."""
    await fires.ensure_indexes(3600)
    await db.schedules.insert_many(
        [
            {"_id": sid, "name": sid, "target": "t.x", "payload": {}, "revision": 1}
            for sid in entries
        ]
    )
    lease = FixedLease(term=2, ttl_s=1.0)
    dispatcher = Dispatcher(Mirrored(entries), stores_over(db, fires), broker, lease)
    now = dt.datetime.now(dt.UTC)
    view = LeaseView("b", 2, now + dt.timedelta(seconds=1), fired_through=fired_through)
    lead = asyncio.create_task(dispatcher.lead(view))
    try:
        yield dispatcher
    finally:
        lead.cancel()
        await asyncio.gather(lead, return_exceptions=True)


class AdoptionsNoted(Ledger):
    """The ledger, noting the fire ids of each adoption in turn."""

    def __init__(self, fires: Collection) -> None:
        super().__init__(fires)
        self.adoptions: list[list[str]] = []

    async def adopt(self, fire_ids: set[str], term: int, now: dt.datetime) -> set[str]:
        taken = await super().adopt(fire_ids, term, now)
        self.adoptions.append(sorted(fire_ids))
        return taken


class SlowLedger(Ledger):
    """A ledger each of whose calls takes 0.6 s (a round trip and a new connection on a
    slow link)."""

    def __init__(self) -> None:
        super().__init__(unreachable_db().fires)

    async def claimed(self, fire_ids: list[str]) -> set[str]:
        await asyncio.sleep(0.6)
        return set()

    async def claim(self, docs: list[dict[str, Any]]) -> set[str]:
        await asyncio.sleep(0.6)
        return set()


class RenewedLease:
    """A held lease of term 1 whose renew deadline, while it is renewed, lies ``budget_s``
    past each time the term asks what remains (the elector's renewals, as the term sees
    them); after ``lapse`` it ends ``budget_s`` past the last ask. ``asks`` counts them.
    Its ttl is ``ttl_s``."""

    def __init__(self, budget_s: float, ttl_s: float) -> None:
        self.term = 1
        self.budget_s = budget_s
        self.timings = LeaseTimings(ttl_s, 0.7 * ttl_s, 0.2 * ttl_s)
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
