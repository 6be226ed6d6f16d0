"""Publishing renders a fire ahead of its due time (``Publisher.ready``) and only joins
the parts at its publish: the message then carries the instant it is fired at, and a
schedule changed in between is rendered afresh (pure logic, fakes for the I/O)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from pymongo.errors import AutoReconnect

from hascheduler.brokers.base import FireMessage
from hascheduler.core.claims import Claim
from hascheduler.core.entries import Entry
from hascheduler.core.events import PreparedEvent
from hascheduler.core.triggers import Interval, fire_id, iso_utc
from hascheduler.process.metrics import Metrics
from hascheduler.replica.overlap import OverlapGate
from hascheduler.replica.publishing import DispatchSettings, Publisher
from hascheduler.storage.collection import Collection
from hascheduler.storage.fire_counts import FireCounts
from hascheduler.storage.fires import Ledger
from hascheduler.storage.runs import RunLedger
from hascheduler.storage.schedules import ScheduleStore
from tests.dispatching import unreachable_db
from tests.waiting import still_pending, wait_until

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
T = TypeVar("T")


@dataclass
class HeldTerm:
    """A term that holds its lease throughout (these publishes pass no overlap gate)."""

    number: int = 7
    holds: bool = True

    async def read(self, work: Coroutine[Any, Any, T]) -> T:
        return await work

    async def write(self, work: Coroutine[Any, Any, T]) -> T:
        return await work


HELD = HeldTerm()


class RecordingBroker:
    """Acknowledges every message, keeping it."""

    def __init__(self) -> None:
        self.sent: list[FireMessage] = []

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def publish(
        self, messages: Sequence[FireMessage], timeout_s: float
    ) -> list[BaseException | None]:
        self.sent.extend(messages)
        return [None] * len(messages)


class FramingBroker(RecordingBroker):
    """A broker that frames fires ahead (as NATS does): what it staged comes back to it at
    the publish, fired then."""

    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.refuse = refuse  # fire ids it cannot frame
        self.staged_sent: list[FireMessage] = []

    def stage(self, event: PreparedEvent) -> tuple[str, PreparedEvent] | None:
        return None if event.fire_id in self.refuse else ("framed", event)

    async def publish_staged(
        self, staged: Sequence[tuple[str, PreparedEvent]], fired: bytes, timeout_s: float
    ) -> list[BaseException | None]:
        self.staged_sent.extend(event.message(fired) for _, event in staged)
        return [None] * len(staged)


class MarkingLedger(Ledger):
    """The fire ledger's marks of published fires, kept; a write held while ``gate`` is
    clear."""

    def __init__(self) -> None:
        super().__init__(unreachable_db().fires)
        self.writes: list[list[tuple[list[str], int, dt.datetime, int]]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def mark_published_many(
        self, marks: list[tuple[list[str], int, dt.datetime, int]]
    ) -> None:
        self.writes.append(marks)
        await self.gate.wait()


class Schedules:
    def __init__(self) -> None:
        self.docs: dict[str, dict[str, Any]] = {}
        self.reads = 0

    async def find(
        self, query: dict[str, Any], projection: Any = None
    ) -> AsyncIterator[dict[str, Any]]:
        self.reads += 1
        for sid in query["_id"]["$in"]:
            if sid in self.docs:
                yield self.docs[sid]


class Mirror:
    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}


def schedule(revision: int, payload: dict[str, Any]) -> dict[str, Any]:
    return {"_id": "s", "name": "s", "target": "t.x", "payload": payload, "revision": revision}


def claims(n: int) -> list[Claim]:
    out = []
    for i in range(n):
        nominal = T0 + dt.timedelta(seconds=i)
        out.append(Claim(fire_id("s", nominal), "s", nominal, nominal))
    return out


def setup(
    ledger: MarkingLedger | None = None,
) -> tuple[Publisher, RecordingBroker, Schedules, Mirror, list[dt.datetime]]:
    broker, schedules, mirror = RecordingBroker(), Schedules(), Mirror()
    now = [T0 - dt.timedelta(seconds=0.25)]
    db = unreachable_db()
    clock, metrics = (lambda: now[0]), Metrics()
    fires = ledger or MarkingLedger()
    publisher = Publisher(
        broker,
        fires,
        mirror,
        ScheduleStore(cast(Collection, schedules)),  # the one call the store makes
        OverlapGate(fires, RunLedger(db.runs), mirror.entries, 100, clock, metrics),
        FireCounts(db.fire_counts),
        DispatchSettings(),
        clock,
        metrics,
    )
    schedules.docs["s"] = schedule(1, {"v": 1})
    mirror.entries["s"] = Entry(1, False, Interval(1.0, T0), 0.0, "all", 3600.0, "t.x")
    return publisher, broker, schedules, mirror, now


async def test_a_fire_rendered_ahead_carries_the_instant_of_its_publish() -> None:
    publisher, broker, schedules, _, now = setup()
    due = claims(3)
    await publisher.templates({"s"})
    publisher.ready(due, 7)
    now[0] = T0 + dt.timedelta(milliseconds=4)
    await publisher.publish_admitted(due, HELD, unchanged=False)
    assert schedules.reads == 1  # the template was read once, ahead
    assert [m.fire_id for m in broker.sent] == [c.fire_id for c in due]
    for message, claim in zip(broker.sent, due, strict=True):
        event = json.loads(message.body)
        assert event["time"] == event["data"]["fired_at"] == iso_utc(now[0])
        assert event["data"]["nominal_at"] == iso_utc(claim.nominal_at)
        assert (event["data"]["term"], event["data"]["attempt"]) == (7, 1)
        assert event["data"]["payload"] == {"v": 1}
    assert not publisher._ready  # published: nothing kept


async def test_a_schedule_changed_after_its_fire_was_rendered_is_rendered_afresh() -> None:
    publisher, broker, schedules, mirror, now = setup()
    due = claims(2)
    await publisher.templates({"s"})
    publisher.ready(due, 7)
    # Edited meanwhile: the mirror applies the change and the publisher forgets the old
    # template (Dispatcher.on_change).
    schedules.docs["s"] = schedule(2, {"v": 2})
    mirror.entries["s"] = Entry(2, False, Interval(1.0, T0), 0.0, "all", 3600.0, "t.x")
    publisher.forget("s")
    now[0] = T0
    await publisher.publish_admitted(due, HELD, unchanged=False)
    assert [json.loads(m.body)["data"]["payload"] for m in broker.sent] == [{"v": 2}] * 2


async def test_fires_rendered_ahead_go_framed_ahead_to_a_broker_that_stages_them() -> None:
    """Every fire of a publish framed ahead: the broker joins in the instant (one join
    for the batch, brokers/nats/publisher.py); one not framed, a schedule changed since,
    or a retry, and the whole publish goes as messages, rendered as without staging."""
    publisher, _, schedules, mirror, now = setup()
    broker = publisher.broker = FramingBroker(refuse=frozenset({claims(5)[4].fire_id}))
    await publisher.templates({"s"})
    due = claims(5)
    publisher.ready(due, 7)
    now[0] = T0 + dt.timedelta(milliseconds=4)
    await publisher.publish_admitted(due[:3], HELD, unchanged=False)
    assert [m.fire_id for m in broker.staged_sent] == [c.fire_id for c in due[:3]]
    assert not broker.sent
    for message in broker.staged_sent:
        event = json.loads(message.body)
        assert event["time"] == event["data"]["fired_at"] == iso_utc(now[0])
    # The last fire was not framed (the broker could not): all of its publish as messages.
    await publisher.publish_admitted(due[3:], HELD, unchanged=False)
    assert [m.fire_id for m in broker.sent] == [c.fire_id for c in due[3:]]
    assert json.loads(broker.sent[0].body)["time"] == iso_utc(now[0])
    # A retry is rendered afresh, with its attempt: a message too.
    await publisher.publish(due[:1], HELD, attempt=2)
    assert json.loads(broker.sent[-1].body)["data"]["attempt"] == 2
    # A schedule changed after its fires were framed: rendered afresh, as messages.
    again = [
        Claim(
            fire_id("s", T0 + dt.timedelta(seconds=9)),
            "s",
            T0 + dt.timedelta(seconds=9),
            T0 + dt.timedelta(seconds=9),
        )
    ]
    publisher.ready(again, 7)
    schedules.docs["s"] = schedule(2, {"v": 2})
    mirror.entries["s"] = Entry(2, False, Interval(1.0, T0), 0.0, "all", 3600.0, "t.x")
    publisher.forget("s")
    await publisher.publish_admitted(again, HELD, unchanged=False)
    assert json.loads(broker.sent[-1].body)["data"]["payload"] == {"v": 2}
    assert len(broker.staged_sent) == 3
    assert not publisher._ready


async def test_an_unchanged_publish_takes_the_templates_its_fires_were_rendered_from() -> None:
    """``unchanged``: the caller counted no change (``changes``, which ``forget`` counts)
    since the fires were rendered ahead, so their templates are not looked up again; a
    fire not rendered ahead is, as before."""
    publisher, broker, _, _, now = setup()
    await publisher.templates({"s"})
    due = claims(3)
    publisher.ready(due[:2], 7)
    looked_up: list[set[str]] = []
    templates = publisher.templates

    async def spied(ids: set[str]) -> Any:
        looked_up.append(ids)
        return await templates(ids)

    publisher.templates = spied  # type: ignore[method-assign]
    now[0] = T0 + dt.timedelta(milliseconds=4)
    await publisher.publish_admitted(due[:2], HELD, unchanged=True)
    assert looked_up == []
    assert [m.fire_id for m in broker.sent] == [c.fire_id for c in due[:2]]
    assert json.loads(broker.sent[0].body)["data"]["payload"] == {"v": 1}
    await publisher.publish_admitted(due[2:], HELD, unchanged=True)
    assert looked_up == [{"s"}]  # not rendered ahead: looked up
    assert len(broker.sent) == 3
    before = publisher.changes
    publisher.forget("s")
    assert publisher.changes == before + 1


async def test_a_retry_is_rendered_with_its_attempt_and_a_discarded_fire_leaves_nothing() -> None:
    publisher, broker, _, _, now = setup()
    due = claims(2)
    await publisher.templates({"s"})
    publisher.ready(due, 7)
    now[0] = T0 + dt.timedelta(seconds=3)
    await publisher.publish(due[:1], HELD, attempt=2)
    assert json.loads(broker.sent[0].body)["data"]["attempt"] == 2
    assert json.loads(broker.sent[0].body)["time"] == iso_utc(now[0])
    publisher.discard(due)
    assert not publisher._ready


async def test_a_publish_does_not_wait_for_its_mark_and_marks_ending_meanwhile_go_together() -> (
    None
):
    """A publish returns once the broker acknowledged it: the next tick's fires do not
    wait for this one's database round trip. The marks of publishes ending while a write
    is in flight go together in the next write; ``marked`` waits for every one."""
    ledger = MarkingLedger()
    publisher, _, _, _, now = setup(ledger)
    now[0] = T0
    due = claims(3)
    ledger.gate.clear()  # the first write stays in flight
    await asyncio.wait_for(publisher.publish(due[:1], HELD, attempt=1), 5)
    await wait_until(lambda: ledger.writes, 5, "the first write")
    for claim in due[1:]:
        await asyncio.wait_for(publisher.publish([claim], HELD, attempt=1), 5)
    # Both marks gathered behind the first write.
    await wait_until(lambda: len(publisher._marks) == 2, 5, "two marks gathered")
    assert len(ledger.writes) == 1
    marked = asyncio.create_task(publisher.marked())
    await still_pending(marked, 0.2, "marked while the first write is in flight")
    ledger.gate.set()
    await asyncio.wait_for(marked, 5)
    assert [[ids for ids, *_ in write] for write in ledger.writes] == [
        [[due[0].fire_id]],
        [[due[1].fire_id], [due[2].fire_id]],
    ]


async def test_a_mark_that_fails_leaves_its_fires_to_the_retry_loop_and_is_said(
    capsys: Any,
) -> None:
    """The publish stands (the broker has the fires); the fires stay claimed in the
    ledger, so the retry loop republishes them (deduplicated), and the failure is
    logged, not raised into the publishing of the fires due next."""

    class Refusing(MarkingLedger):
        async def mark_published_many(
            self, marks: list[tuple[list[str], int, dt.datetime, int]]
        ) -> None:
            raise AutoReconnect("the database is gone")

    publisher, broker, _, _, now = setup(Refusing())
    now[0] = T0
    due = claims(2)
    await publisher.publish(due, HELD, attempt=1)
    await asyncio.wait_for(publisher.marked(), 5)
    assert [m.fire_id for m in broker.sent] == [c.fire_id for c in due]
    assert "fires_unmarked" in (out := capsys.readouterr().out)
    assert "count=2" in out  # every fire the failed write held


class HeldBroker(RecordingBroker):
    """Acknowledges a publish of fires whose ids are in ``held`` only once ``release``
    is set; the others at once."""

    def __init__(self, held: set[str]) -> None:
        super().__init__()
        self.held, self.release = held, asyncio.Event()

    async def publish(
        self, messages: Sequence[FireMessage], timeout_s: float
    ) -> list[BaseException | None]:
        if any(m.fire_id in self.held for m in messages):
            await self.release.wait()
        return await super().publish(messages, timeout_s)


async def test_a_batchs_metrics_and_lines_wait_while_another_batch_awaits_the_broker() -> None:
    """A batch's publish time is when its acks are read: the per-fire lateness metric and
    debug lines of batches already acknowledged wait (like their marks) until no batch
    awaits the broker, so that they do not hold back the reading of the others' acks."""
    publisher, _, _, _, now = setup()
    now[0] = T0
    due = claims(3)
    broker = HeldBroker({due[2].fire_id})
    publisher.broker = broker
    awaiting_at_each: list[int] = []  # batches awaiting the broker at each observation
    observe = publisher.metrics.lateness.observe

    def noted(amount: float, exemplar: dict[str, str] | None = None) -> None:
        awaiting_at_each.append(publisher._awaiting_broker)
        observe(amount, exemplar)

    publisher.metrics.lateness.observe = noted  # type: ignore[method-assign]
    late = asyncio.create_task(publisher.publish(due[2:], HELD, attempt=1))
    await wait_until(lambda: publisher._awaiting_broker == 1, 5, "the held batch sent")
    await asyncio.wait_for(publisher.publish(due[:2], HELD, attempt=1), 5)
    broker.release.set()
    await asyncio.wait_for(late, 5)
    await asyncio.wait_for(publisher.marked(), 5)
    assert awaiting_at_each == [0, 0, 0]
