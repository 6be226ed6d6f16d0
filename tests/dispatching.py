"""What the tests of the leader's work share: fakes of its parts and a leading dispatcher
over the development server."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from hascheduler.core.claims import Claim
from hascheduler.core.entries import Entry
from hascheduler.replica.dispatch import Dispatcher
from hascheduler.replica.overlap import Fenced
from hascheduler.replica.term import Term

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def at(minutes: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


def bare_dispatcher(entries: dict[str, Entry], lease: Any) -> Dispatcher:
    """A dispatcher over ``entries`` with no database and no broker: for what its queue,
    its loop and its fakes do."""
    return Dispatcher(
        SimpleNamespace(entries=entries),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        lease,
    )


@contextlib.asynccontextmanager
async def changes_applied(
    entries: dict[str, Entry], watermark: dt.datetime | None
) -> AsyncIterator[tuple[Dispatcher, Term]]:
    """A dispatcher over ``entries`` leading a term whose loop has got to ``watermark``
    (no database, no broker: for what a change queues)."""
    lease = SimpleNamespace(valid=True, term=1)
    dispatcher = bare_dispatcher(entries, lease)
    async with Term(1, lease, entries) as term:  # type: ignore[arg-type]
        dispatcher.term = term
        if watermark is not None:
            term.advance(watermark)
        yield dispatcher, term


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


def publishing_dispatcher(
    entries: dict[str, Entry], publisher: NotedPublisher, ledger: Any = None
) -> tuple[Dispatcher, Any]:
    """A dispatcher over ``entries`` publishing through ``publisher``, and its lease."""
    lease = SimpleNamespace(
        valid=True, term=1, remaining=lambda: 5.0, timings=SimpleNamespace(ttl=10.0)
    )
    dispatcher = Dispatcher(
        SimpleNamespace(entries=entries),
        None,
        ledger,
        None,  # type: ignore[arg-type]
        lease,
    )  # type: ignore[arg-type]
    dispatcher.publisher = dispatcher.firing.publisher = publisher  # type: ignore[assignment]
    return dispatcher, lease


class AckingBroker:
    """Acknowledges every message, noting its fire id."""

    def __init__(self, sent: list[str]) -> None:
        self.sent = sent

    async def publish(self, messages: list[Any], timeout_s: float) -> list[BaseException | None]:
        self.sent.extend(m.fire_id for m in messages)
        return [None] * len(messages)


class OneSchedule:
    """The stored schedules: "s" alone."""

    async def find(
        self, query: dict[str, Any], projection: Any = None
    ) -> AsyncIterator[dict[str, Any]]:
        yield {"_id": "s", "name": "s", "target": "t.x", "payload": {}, "revision": 1}


@contextlib.asynccontextmanager
async def leading(
    db: Any, fires: Any, entries: dict[str, Entry], broker: Any, fired_through: dt.datetime
) -> AsyncIterator[Dispatcher]:
    """A dispatcher leading term 2 over ``entries`` (stored as schedules), its predecessor's
    watermark ``fired_through``; stopped on the way out."""
    from hascheduler.storage.lease import LeaseView

    await fires.ensure_indexes(3600)
    await db.schedules.insert_many(
        [
            {"_id": sid, "name": sid, "target": "t.x", "payload": {}, "revision": 1}
            for sid in entries
        ]
    )
    lease = SimpleNamespace(
        valid=True, term=2, remaining=lambda: 5.0, timings=SimpleNamespace(ttl=1.0)
    )
    dispatcher = Dispatcher(SimpleNamespace(entries=entries), db.schedules, fires, broker, lease)
    now = dt.datetime.now(dt.UTC)
    view = LeaseView("b", 2, now + dt.timedelta(seconds=1), fired_through=fired_through)
    lead = asyncio.create_task(dispatcher.lead(view))
    try:
        yield dispatcher
    finally:
        lead.cancel()
        await asyncio.gather(lead, return_exceptions=True)


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


class SlowLedger:
    """A ledger each of whose calls takes 0.6 s (a round trip and a new connection on a
    slow link)."""

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
