"""Publishing claimed fires: render each as its event, hand a batch to the broker (at most
``max_in_flight_batches`` awaiting it at once), mark the acknowledged ones published, and
schedule a retry, with backoff, of the others, or record them failed (invariant 5,
docs/ARCHITECTURE.md).

Every ledger write carries the publishing term, and the ledger matches only claims of that
term: a deposed leader's late write changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import structlog
from pymongo.errors import PyMongoError

from hascheduler.brokers.base import Broker, BrokerUnavailable, StagingBroker
from hascheduler.core.claims import Claim
from hascheduler.core.clock import Clock
from hascheduler.core.constants import DEFAULT_MAX_BUFFERED, DEFAULT_MAX_FAN_OUT
from hascheduler.core.entries import Entry
from hascheduler.core.events import EventTemplate, PreparedEvent, fired_field
from hascheduler.core.triggers import iso_utc
from hascheduler.process import tracing
from hascheduler.process.metrics import Metrics
from hascheduler.replica.overlap import Fenced, OverlapGate
from hascheduler.storage.fire_counts import FireCounts
from hascheduler.storage.fires import Ledger
from hascheduler.storage.schedules import ScheduleStore

log = structlog.get_logger("hascheduler.dispatch")

# Marking fires published waits at most this long for the other batches then awaiting
# the broker (see Publisher.publish).
MARK_DEFER_MAX_S = 0.5


@dataclass(frozen=True)
class DispatchSettings:
    publish_timeout_s: float = 5.0
    max_attempts: int = 10
    backoff_base_s: float = 0.5
    backoff_cap_s: float = 30.0
    unavailable_backoff_cap_s: float = 2.0
    max_unavailable_s: float = 300.0  # below the broker's duplicate window (600 s)
    retry_interval_s: float = 0.5
    drain_timeout_s: float = 5.0
    retention_s: float = 7 * 86_400.0
    # Above the claim batches of a second's aligned fires at the rates benchmarked
    # (docs/FIRING.md): a batch waiting for a slot waits for the first ones' acks.
    max_in_flight_batches: int = 16
    max_fan_out: int = DEFAULT_MAX_FAN_OUT  # tenants one fan-out fire may select
    max_buffered: int = DEFAULT_MAX_BUFFERED  # fires one run key may hold waiting


class MirroredSchedules(Protocol):
    """What firing reads of the mirror: the current entries by schedule id."""

    @property
    def entries(self) -> Mapping[str, Entry]: ...


def backoff_s(attempt: int, base_s: float, cap_s: float, rand: float) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, base * 2^attempt))."""
    return float(rand * min(cap_s, base_s * 2 ** min(attempt, 30)))


# A fire's publish span (None: not sampled), and the trace context its message carries.
Traced = tuple[tracing.Span | None, dict[str, str]]


class Rendered(NamedTuple):
    """An admitted fire rendered ahead of its due time but for the instant it is fired at
    (``Publisher.ready``)."""

    template: EventTemplate  # what it was rendered from: stale once its schedule changed
    prepared: PreparedEvent
    traced: Traced | None
    staged: Any  # its frame, when the broker stages them (None otherwise)


class Publisher:
    def __init__(
        self,
        broker: Broker,
        ledger: Ledger,
        mirror: MirroredSchedules,
        store: ScheduleStore,
        gate: OverlapGate,
        counts: FireCounts,
        settings: DispatchSettings,
        clock: Clock,
        metrics: Metrics,
    ) -> None:
        self.broker = broker
        self.gate = gate
        self.counts = counts  # max_fires: the fires each schedule used
        self.store = store
        self.ledger = ledger
        self.mirror = mirror
        self.settings = settings
        self.clock = clock
        self.metrics = metrics
        self._slots = asyncio.Semaphore(settings.max_in_flight_batches)
        self._awaiting_broker = 0  # batches sent, acks not all in
        self._broker_idle = asyncio.Event()
        self._broker_idle.set()
        self._marking_tasks: set[asyncio.Task[None]] = set()  # marks behind publishes
        # What a message needs from a schedule (name, target, payload, encoded) by id, with
        # the revision it was read at: a recurring schedule's fires skip the database read.
        self._templates: dict[str, tuple[int, EventTemplate]] = {}
        # Tracing on: each claimed fire's publish span, begun ahead of its due time
        # (``prepare``), with the trace context its message carries.
        self._prepared: dict[str, Traced] = {}
        # Admitted fires awaiting their due time, rendered but for their fired_at
        # (``ready``), with the template they were rendered from, their trace, and their
        # frame when the broker stages them.
        self._ready: dict[str, Rendered] = {}
        self._marks: list[tuple[list[str], int, dt.datetime, int]] = []  # awaiting a write
        # Schedules changed so far (``forget``): a caller that counted the same before it
        # had claims rendered ahead knows their schedules, and templates, stand.
        self.changes = 0
        self._marking = asyncio.Lock()

    @property
    def busy(self) -> bool:
        """A quarter of the publish slots or more await the broker: the fires due now come
        first."""
        return self._awaiting_broker * 4 >= self.settings.max_in_flight_batches

    def forget(self, schedule_id: str) -> None:
        """The schedule changed: its next message is read afresh."""
        self._templates.pop(schedule_id, None)
        self.changes += 1

    async def templates(self, ids: set[str]) -> dict[str, EventTemplate]:
        """The event template (name, target, payload) of each schedule still stored."""
        found: dict[str, EventTemplate] = {}
        for schedule_id in ids:
            entry = self.mirror.entries.get(schedule_id)
            cached = self._templates.get(schedule_id)
            if entry is not None and cached is not None and cached[0] == entry.revision:
                found[schedule_id] = cached[1]
        missing = list(ids - found.keys())
        if missing:
            for doc in await self.store.message_fields(missing):
                template = EventTemplate.of(doc)
                found[doc["_id"]] = template
                self._templates[doc["_id"]] = (doc.get("revision", 0), template)
        for gone in ids - found.keys():
            self._templates.pop(gone, None)
        return found

    def prepare(self, claims: list[Claim]) -> None:
        """Tracing on: begin the claims' publish spans now, at their claim, ahead of their
        due time, so that publishing them then only reads them."""
        if not tracing.enabled():
            return
        for claim in claims:
            cached = self._templates.get(claim.schedule_id)
            if cached is not None:
                self._prepared[claim.fire_id] = _begin_span(claim, cached[1])

    @property
    def _staging(self) -> StagingBroker | None:
        return self.broker if isinstance(self.broker, StagingBroker) else None

    def ready(self, claims: list[Claim], term: int) -> None:
        """Render admitted claims now, ahead of their due time, but for the instant they
        are fired at (and frame them, when the broker stages): their first publish then
        only joins the parts."""
        traced_on = tracing.enabled()
        staging = self._staging
        for claim in claims:
            cached = self._templates.get(claim.schedule_id)
            if cached is None:
                continue  # read at the publish
            template = _own_template(cached[1], claim)
            traced = self._traced(claim, template, term, 1) if traced_on else None
            prepared = template.prepare(
                claim.fire_id,
                claim.nominal_at,
                claim.tenant,
                term,
                1,
                None if traced is None else traced[1],
            )
            self._ready[claim.fire_id] = Rendered(
                cached[1], prepared, traced, staging.stage(prepared) if staging else None
            )

    def discard(self, claims: list[Claim]) -> None:
        """The claims are settled, published or not: their prepared spans and renderings
        go."""
        if self._prepared or self._ready:
            for claim in claims:
                self._prepared.pop(claim.fire_id, None)
                self._ready.pop(claim.fire_id, None)

    def _traced(self, claim: Claim, template: EventTemplate, term: int, attempt: int) -> Traced:
        traced = self._prepared.pop(claim.fire_id, None) or _begin_span(claim, template)
        if traced[0] is not None and traced[0].is_recording():
            _annotate(traced[0], claim, template, term, attempt)
        return traced

    async def admit(self, claims: list[Claim], term: Fenced) -> tuple[list[Claim], list[Claim]]:
        """Ahead of the claims' due time: (those the overlap gate lets through, to publish
        with ``admitted=True``; those it holds, whose run is still open, to publish through
        it at their due time). It records the others skipped or buffered."""
        templates = await self.templates({c.schedule_id for c in claims})
        known = [c for c in claims if c.schedule_id in templates]
        through, held = await self.gate.admit_ahead(
            known, {sid: t.target for sid, t in templates.items()}, term
        )
        passed = {c.fire_id for c in through}
        # A schedule deleted meanwhile is recorded so by publish.
        return [c for c in claims if c.fire_id in passed or c.schedule_id not in templates], held

    async def unadmit(self, claims: list[Claim], term: int) -> None:
        """Admitted claims that will not be published after all: their reserved runs
        are not open."""
        await self.gate.unreserve(claims, term)

    async def publish(self, claims: list[Claim], term: Fenced, attempt: int) -> None:
        """Publish claimed fires through the overlap gate: a retry, an adopted claim, a
        fire run now, one held ahead of its due time; mark each published (behind the
        publish: ``marked`` waits for the marks), or schedule its retry."""
        await self._publish(claims, term, attempt, released=False, admitted=False, unchanged=False)

    async def publish_admitted(self, claims: list[Claim], term: Fenced, unchanged: bool) -> None:
        """Publish, at their due time, claims the gate admitted ahead (``admit``) and that
        were rendered then (``ready``); ``unchanged``: no schedule changed (``changes``)
        since, so the templates they were rendered from stand."""
        await self._publish(claims, term, 1, released=False, admitted=True, unchanged=unchanged)

    async def publish_released(self, claims: list[Claim], term: Fenced) -> None:
        """Publish buffered fires whose wait is over: they go ahead of the fires still
        waiting."""
        await self._publish(claims, term, 1, released=True, admitted=False, unchanged=False)

    async def _publish(  # noqa: C901, PLR0915 (the hot path, in one frame)
        self,
        claims: list[Claim],
        term: Fenced,
        attempt: int,
        released: bool,
        admitted: bool,
        unchanged: bool,
    ) -> None:
        number = term.number
        rendered = self._ready
        if unchanged and attempt == 1 and all(c.fire_id in rendered for c in claims):
            templates = {c.schedule_id: rendered[c.fire_id].template for c in claims}
        else:
            templates = await self.templates({c.schedule_id for c in claims})
        gone = [c for c in claims if c.schedule_id not in templates]
        if gone:
            self.metrics.fires.labels("skipped").inc(len(gone))
            await self.ledger.skip(
                [c.fire_id for c in gone], number, "schedule deleted before its fire was published"
            )
            if admitted:
                await self.unadmit(gone, number)
        sendable = [c for c in claims if c.schedule_id in templates]
        if not admitted:
            sendable = await self.gate.admit(
                sendable, {sid: t.target for sid, t in templates.items()}, term, released
            )
        sendable = await self._within_max_fires(sendable, number)
        if not sendable:
            return
        fired = fired_field(iso_utc(self.clock()))
        traced_on = tracing.enabled()
        spans: list[tracing.Span | None] | None = [] if traced_on else None
        events: list[PreparedEvent] = []
        # Every fire framed ahead, by a broker that stages: the publish joins the instant
        # into the frames; any other, and every fire goes as a message.
        staging = self._staging if attempt == 1 else None
        staged: list[Any] = []
        for claim in sendable:
            template = templates[claim.schedule_id]
            ready = self._ready.pop(claim.fire_id, None) if attempt == 1 else None
            if ready is not None and ready.template is template:  # unchanged since
                prepared, traced = ready.prepared, ready.traced
                if staging is not None:
                    if ready.staged is None:
                        staging = None
                    else:
                        staged.append(ready.staged)
            else:
                staging = None
                template = _own_template(template, claim)
                traced = (
                    ready.traced
                    if ready is not None
                    else self._traced(claim, template, number, attempt)
                    if traced_on
                    else None
                )
                prepared = template.prepare(
                    claim.fire_id,
                    claim.nominal_at,
                    claim.tenant,
                    number,
                    attempt,
                    None if traced is None else traced[1],
                )
            if spans is not None:
                spans.append(None if traced is None else traced[0])
            events.append(prepared)
        # The slot bounds what awaits the broker; marking below is outside it, so a batch
        # due now never waits for an earlier batch's database round trip.
        async with self._slots:
            self._awaiting_broker += 1
            self._broker_idle.clear()
            try:
                sent = self.clock()
                timeout_s = self.settings.publish_timeout_s
                if staging is not None:
                    outcomes = await staging.publish_staged(staged, fired, timeout_s)
                else:
                    outcomes = await self.broker.publish(
                        [event.message(fired) for event in events], timeout_s
                    )
                acked_at = self.clock()
            finally:
                self._awaiting_broker -= 1
                if not self._awaiting_broker:
                    self._broker_idle.set()
        self.metrics.publish_seconds.observe((acked_at - sent).total_seconds())
        if spans is not None:
            _end_publish_spans(spans, outcomes)
        done = [c for c, error in zip(sendable, outcomes, strict=True) if error is None]
        if done:
            # Marked behind the publish: the next tick's fires do not wait for this one's
            # database round trip (``marked`` waits for it).
            task = asyncio.create_task(self._mark(done, number, acked_at, attempt))
            self._marking_tasks.add(task)
            task.add_done_callback(self._marking_tasks.discard)
            if spans is not None:  # a sampled fire's line joins its trace
                for claim, span, error in zip(sendable, spans, outcomes, strict=True):
                    if span is not None and tracing.sampled(span):
                        with tracing.attached(tracing.parent_of(span)):
                            log.info(
                                "fire_traced",
                                fire_id=claim.fire_id,
                                term=number,
                                published=error is None,
                            )
        failures = [(c, e) for c, e in zip(sendable, outcomes, strict=True) if e is not None]
        for claim, error in failures:
            await self.record_failure(claim, number, attempt, error)
        if failures:
            log.warning(
                "publish_failed",
                count=len(failures),
                term=number,
                attempt=attempt,
                error=repr(failures[0][1]),
            )

    async def marked(self) -> None:
        """Once the marks of the publishes made so far are written (or failed)."""
        while self._marking_tasks:
            await asyncio.wait(list(self._marking_tasks))

    async def _mark(self, done: list[Claim], term: int, at: dt.datetime, attempt: int) -> None:
        """Mark published fires, behind their publish, in a group commit: while one write
        is in flight, the marks of the publishes that end meanwhile gather and go in the
        next write together, not a write per publishing tick. First it waits (briefly) for
        the batches published with these, so the database's work for the first batches
        does not slow the broker's acks of the last ones; the fires' metrics and debug
        lines wait too, so making them does not hold back the reading of the next
        batches' acks. A failed write leaves every fire it held claimed: the retry loop
        republishes them (deduplicated by the broker, run once by the runs ledger)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._broker_idle.wait(), MARK_DEFER_MAX_S)
        self.metrics.fires.labels("published").inc(len(done))
        # The logger's method looked up once, not through structlog's lazy proxy per fire.
        observe, fired = self.metrics.lateness.observe, log.debug
        for claim in done:
            observe((at - claim.due_at).total_seconds())
            fired("fired", fire_id=claim.fire_id, term=term, attempt=attempt)
        self._marks.append(([c.fire_id for c in done], term, at, attempt))
        async with self._marking:
            marks, self._marks = self._marks, []
            if not marks:
                return  # another publish's write took these
            try:
                await self.ledger.mark_published_many(marks)
            except PyMongoError as exc:
                log.warning(
                    "fires_unmarked",
                    count=sum(len(ids) for ids, *_ in marks),
                    term=term,
                    error=repr(exc)[:300],
                )

    async def _within_max_fires(self, claims: list[Claim], term: int) -> list[Claim]:
        """The claims that fit their schedule's max_fires (each counted once, runs now
        not counted); the others are skipped, and a schedule whose fires are all used is
        completed."""
        keep: list[Claim] = []
        refused: list[Claim] = []
        used_up: dict[str, int] = {}
        for claim in claims:
            entry = self.mirror.entries.get(claim.schedule_id)
            limit = entry.max_fires if entry is not None else None
            if limit is None or claim.manual:
                keep.append(claim)
                continue
            counted = await self.counts.take(claim.schedule_id, claim.fire_id, limit)
            if counted is None:
                refused.append(claim)
            else:
                keep.append(claim)
            if counted is None or counted >= limit:
                used_up[claim.schedule_id] = limit
        if refused:
            await self.ledger.skip([c.fire_id for c in refused], term, "max_fires reached")
            self.metrics.fires.labels("skipped").inc(len(refused))
            await self.gate.unreserve(refused, term)
        for schedule_id, limit in used_up.items():
            if await self.store.complete(schedule_id, limit, self.clock()):
                log.info("schedule_completed", schedule_id=schedule_id, max_fires=limit)
        return keep

    async def record_failure(
        self, claim: Claim, term: int, attempt: int, error: BaseException
    ) -> None:
        now = self.clock()
        # An unavailable broker is no fault of the fire's: it waits and is tried again soon
        # after the broker is back (a stream's election takes seconds), for as long as a
        # republish is still deduplicated (max_unavailable_s < the duplicate window).
        unavailable = (
            isinstance(error, BrokerUnavailable)
            and (now - claim.due_at).total_seconds() < self.settings.max_unavailable_s
        )
        if attempt >= self.settings.max_attempts and not unavailable:
            await self.ledger.mark_failed(claim.fire_id, term, attempt, repr(error), now)
            self.metrics.fires.labels("failed").inc()
            # Never published: its reserved run is not open, nor does it count against
            # max_fires.
            await self.gate.unreserve([claim], term)
            await self.counts.release(claim.schedule_id, claim.fire_id)
        else:
            cap = (
                self.settings.unavailable_backoff_cap_s
                if unavailable
                else self.settings.backoff_cap_s
            )
            delay = backoff_s(attempt, self.settings.backoff_base_s, cap, random.random())
            await self.ledger.retry_later(
                claim.fire_id, term, attempt, repr(error), now + dt.timedelta(seconds=delay)
            )


def _own_template(template: EventTemplate, claim: Claim) -> EventTemplate:
    """The template as ``claim`` renders it: a fire run now may carry its own payload and
    priority."""
    if claim.payload is not None:
        template = template.with_payload(claim.payload)
    if claim.priority is not None:
        template = template.with_priority(claim.priority)
    return template


def _begin_span(claim: Claim, template: EventTemplate) -> Traced:
    """A fire's producer span (None when it is not sampled) and the trace context its
    message carries: a fire run now continues the trace of the request that asked for it;
    a fire of its trigger starts a trace."""
    name = f"publish {template.target}"
    parent = tracing.context_of(claim.traceparent)
    if parent is None:
        return tracing.begin_root(name, tracing.SpanKind.PRODUCER)
    span = tracing.tracer().start_span(name, context=parent, kind=tracing.SpanKind.PRODUCER)
    return span, tracing.carried(span)


def _annotate(
    span: tracing.Span, claim: Claim, template: EventTemplate, term: int, attempt: int
) -> None:
    """A sampled fire's span: what it is, and a link to the trace of the write that last
    changed its schedule."""
    for link in tracing.link_of(template.written_in):
        span.add_link(link.context)
    span.set_attributes(
        {
            "messaging.operation.type": "publish",
            "messaging.destination.name": template.target,
            "messaging.message.id": claim.fire_id,
            "hascheduler.schedule_id": claim.schedule_id,
            "hascheduler.nominal_at": iso_utc(claim.nominal_at),
            "hascheduler.term": term,
            "hascheduler.attempt": attempt,
        }
    )
    if claim.tenant is not None:
        span.set_attribute("hascheduler.tenant", claim.tenant)


def _end_publish_spans(
    spans: list[tracing.Span | None], outcomes: list[BaseException | None]
) -> None:
    for span, error in zip(spans, outcomes, strict=True):
        if span is None:
            continue
        if error is not None:
            span.record_exception(error)
            span.set_status(tracing.Status(tracing.StatusCode.ERROR, repr(error)[:200]))
        span.end()
