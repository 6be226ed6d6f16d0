"""The leader's firing engine: claim each due fire once, publish it, mark it published.

Invariants 4 and 5 (docs/ARCHITECTURE.md). A fire's id is ``<schedule_id>@<nominal UTC
time>``; it is claimed by inserting that id into ``fires`` (a duplicate key means another
leader owns it), only while the lease is valid, and every ledger write carries the term.
Publishing uses the fire id as the broker's dedup key, so republishing after a failover is
safe. Claims are made up to CLAIM_AHEAD_S before the due time and re-checked against the
mirror when it comes (a schedule paused, deleted or edited meanwhile is recorded as
skipped). On becoming leader: adopt and republish claims left by older terms, then fire
what fell due since the previous leader's watermark, per schedule catch-up policy,
recording every skipped time with its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from .brokers import Broker, BrokerUnavailable
from .catchup import SkippedRange, plan_catchup
from .constants import DEFAULT_MAX_FAN_OUT, SOURCE_SYNC_WAIT_S
from .events import EventTemplate
from .fanout import FanOut, tenant_fire_id
from .fire_queue import Due, FireQueue, is_fire_time
from .lease import LeaseTimings, LeaseView
from .ledger import Ledger, claim_document, skipped_range_document
from .metrics import Metrics
from .mirror import Entry
from .triggers import fire_id, iso_utc, jitter_offset

log = structlog.get_logger("hascheduler.dispatch")

Clock = Callable[[], dt.datetime]

# Fires claimed (and published) per database round trip. Bounded so that one burst never
# holds the database longer than a lease renewal can wait: with 10,000 claims in one
# insert, the single-threaded development server starved the leader's renewal past its
# deadline and leadership thrashed mid-burst.
CLAIM_BATCH = 1000
# Fires are claimed up to this long before they are due, and published at their due time
# after a re-check (paused, deleted, edited meanwhile): a burst's claims are then made
# before its second instead of delaying its publishes. The claims of 10,000 fires due
# together take about a third of a second of the development server's time. A second and
# a half, not two: cron fires cluster on whole seconds, and claiming the next-but-one
# second's fires then happens mid-second instead of at the instant this second's publish.
# A claim made ahead is published only if its term still holds the lease at the due time.
CLAIM_AHEAD_S = 1.5


# Retries published per turn of the retry loop, a claim batch each: a 10,000 burst held up
# by a broker outage goes out in one turn, and the loop still yields between batches.
RETRY_BATCHES_PER_TURN = 20

# Marking fires published waits at most this long for the other batches then awaiting
# the broker (see _publish).
MARK_DEFER_MAX_S = 0.5


class MirroredSchedules(Protocol):
    """What the dispatcher reads of the mirror: the current entries by schedule id."""

    @property
    def entries(self) -> Mapping[str, Entry]: ...


class HeldLease(Protocol):
    """What the dispatcher asks of the lease before each claim and publish."""

    @property
    def valid(self) -> bool: ...

    @property
    def term(self) -> int | None: ...

    @property
    def timings(self) -> LeaseTimings: ...

    def remaining(self) -> float: ...


class StoredSchedules(Protocol):
    """The schedules collection, read for what a message carries (name, target, payload)."""

    def find(self, *args: Any, **kwargs: Any) -> Any: ...


class TenantSource(Protocol):
    """The tenants a fan-out selects now, from the replica's source mirrors (tenants.py);
    None while that source's mirror is not in sync."""

    def tenants(self, fan_out: FanOut) -> list[str] | None: ...

    async def wait_ready(self, fan_out: FanOut, timeout_s: float) -> bool: ...


class LeadershipLost(Exception):
    """The renew deadline passed: stop claiming at once."""


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
    max_in_flight_batches: int = 8
    max_fan_out: int = DEFAULT_MAX_FAN_OUT  # tenants one fan-out fire may select


def _plan_catchups(entries: list[tuple[str, Entry]], since: dt.datetime, now: dt.datetime
                   ) -> tuple[list[Due], list[tuple[str, SkippedRange]]]:
    """The schedules' catch-up: the fires due by now (later ones are queued by seeding),
    and the range each skips (pure)."""
    to_fire: list[Due] = []
    skipped: list[tuple[str, SkippedRange]] = []
    for schedule_id, entry in entries:
        start = since - dt.timedelta(seconds=entry.jitter)
        fire, skip = plan_catchup(entry.trigger, entry.catchup, entry.catchup_window,
                                  start, now)
        for nominal in fire:
            fire_at = nominal + jitter_offset(schedule_id, nominal, entry.jitter)
            if fire_at <= now:
                to_fire.append(Due(fire_at, nominal, schedule_id, entry.revision))
        if skip is not None:
            skipped.append((schedule_id, skip))
    return to_fire, skipped


def backoff_s(attempt: int, base_s: float, cap_s: float, rand: float) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, base * 2^attempt))."""
    return float(rand * min(cap_s, base_s * 2 ** min(attempt, 30)))


class Dispatcher:
    def __init__(self, mirror: MirroredSchedules, schedules: StoredSchedules, ledger: Ledger,
                 broker: Broker, lease: HeldLease, settings: DispatchSettings | None = None,
                 clock: Clock = lambda: dt.datetime.now(dt.UTC),
                 metrics: Metrics | None = None, sources: TenantSource | None = None) -> None:
        self.mirror = mirror
        self.sources = sources
        self.metrics = metrics or Metrics()
        self.schedules = schedules
        self.ledger = ledger
        self.broker = broker
        self.lease = lease
        self.settings = settings or DispatchSettings()
        self.clock = clock
        self.watermark: dt.datetime | None = None  # every fire due up to here is handled
        self.term: int | None = None
        self.queue = FireQueue(mirror.entries)
        self._wake = asyncio.Event()
        self._in_flight: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(self.settings.max_in_flight_batches)
        self._awaiting_broker = 0  # batches sent, acks not all in
        self._broker_idle = asyncio.Event()
        self._broker_idle.set()
        # What a message needs from a schedule (name, target, payload, encoded) by id, with
        # the revision it was read at: a recurring schedule's fires skip the database read.
        self._bodies: dict[str, tuple[int, EventTemplate]] = {}
        self._pending: set[str] = set()  # fire ids this replica claimed, not yet published
        # Fan-out fires waiting for their source mirror to be in sync, by fire id.
        self._deferred: dict[str, Due] = {}
        self._waiting_for_sources: set[asyncio.Task[None]] = set()
        # Set by drain(): claims still waiting for their due time are left to the next
        # leader (it adopts them then) instead of holding up the handover.
        self._handing_over = asyncio.Event()
        self.published = 0

    @property
    def fired_through(self) -> dt.datetime | None:
        """What the lease records as handled: the watermark, held back before any fan-out
        fire still waiting for its source, so a next leader's catch-up covers it."""
        if self.watermark is None or not self._deferred:
            return self.watermark
        earliest = min(d.fire_at for d in self._deferred.values())
        return min(self.watermark, earliest - dt.timedelta(microseconds=1))

    # -- mirror changes -------------------------------------------------------------------

    def on_change(self, schedule_id: str, entry: Entry | None) -> None:
        """Called by the mirror for every applied change; reschedules while leading."""
        self._bodies.pop(schedule_id, None)
        if self.term is not None and self.queue.changed(schedule_id, entry, self.watermark):
            self._wake.set()

    # -- leading --------------------------------------------------------------------------

    async def lead(self, view: LeaseView) -> None:
        """Fire as the leader of ``view.term`` until cancelled or the lease lapses."""
        term = view.term
        now = self.clock()
        since = view.fired_through or now
        self.term = term
        self.watermark = None
        self._handing_over = asyncio.Event()
        log.info("leading", term=term, fired_through=since.isoformat())
        try:
            await self._adopt_claims(term, grace_s=0.0)
            await self._retry_due(term)
            await self._catch_up(term, since, now)
            await self._seed(now)
            self.watermark = now
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._retry_loop(term))
                await self._fire_loop(term)
        finally:
            self.term = None
            self.queue.clear()
            # Nothing claimed for these yet: the next leader's catch-up covers them.
            for task in self._waiting_for_sources:
                task.cancel()

    async def _yield(self) -> None:
        await asyncio.sleep(0)
        if not self.lease.valid:
            raise LeadershipLost

    async def _seed(self, now: dt.datetime) -> None:
        for _ in self.queue.seed(now):
            await self._yield()

    async def _fire_loop(self, term: int) -> None:
        while True:
            if not self.lease.valid:
                raise LeadershipLost
            now = self.clock()
            horizon = now + dt.timedelta(seconds=CLAIM_AHEAD_S)
            # A claim batch at a time: each insert yields the loop to the publishes due now
            # (taking 10,000 fires off the heap at once held it for a fifth of a second).
            while batch := self.queue.take_due(horizon, CLAIM_BATCH):
                await self._claim_and_publish(batch, term, now)
            self.watermark = now
            self._wake.clear()
            wait = 0.25  # re-check the lease at least this often
            first = self.queue.first_at()
            if first is not None:
                ahead = first - dt.timedelta(seconds=CLAIM_AHEAD_S)
                wait = min(wait, max(0.0, (ahead - self.clock()).total_seconds()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    async def _claim(self, docs: list[dict[str, Any]], term: int) -> list[dict[str, Any]]:
        """Insert claims; returns those we now own.

        A duplicate key is another term's claim, or one of ours already pending. Another
        term's claim still unpublished was left by a deposed leader (only one lease is
        valid at a time): it is adopted now, at its due time, rather than when the
        periodic adoption comes round.
        """
        if not docs:
            return []
        if not self.lease.valid:
            raise LeadershipLost
        try:
            taken = await asyncio.wait_for(self.ledger.claim(docs),
                                           max(self.lease.remaining(), 0.001))
        except TimeoutError:
            raise LeadershipLost from None
        if not taken:
            return docs
        adopted = await self.ledger.adopt(taken - self._pending, term, self.clock())
        if adopted:
            log.info("adopted_claims", count=len(adopted), term=term, at="due time")
        return [d for d in docs if d["_id"] not in taken or d["_id"] in adopted]

    async def _claim_all(self, dues: list[Due], term: int, now: dt.datetime) -> None:
        for i in range(0, len(dues), CLAIM_BATCH):
            await self._claim_and_publish(dues[i:i + CLAIM_BATCH], term, now)

    async def _claim_and_publish(self, batch: list[Due], term: int, now: dt.datetime,
                                 may_defer: bool = True) -> None:
        hold = self.settings.publish_timeout_s * 2
        docs = []
        unexpanded: list[tuple[Due, str]] = []
        bound = self.settings.max_fan_out
        for due in batch:
            doc = claim_document(due.schedule_id, due.nominal, due.fire_at, term, now)
            # The retry loop leaves it alone unless this publish has not finished by then.
            doc["next_attempt_at"] = now + dt.timedelta(seconds=hold)
            entry = self.mirror.entries.get(due.schedule_id)
            if entry is None or entry.fan_out is None:
                docs.append(doc)
                continue
            # One claim per tenant the fan-out selects now (invariant 10); a tenant gone
            # by the due time is skipped then (_still_due).
            tenants = self.sources.tenants(entry.fan_out) if self.sources else None
            if tenants is None and may_defer and self.sources is not None:
                self._defer(due, entry.fan_out, term)
                continue
            if tenants is None:
                unexpanded.append((due, "fan-out source not in sync within "
                                        f"{SOURCE_SYNC_WAIT_S:g} s of the due time"))
                continue
            if len(tenants) > bound:
                # The source grew past the bound after the write was checked. Firing a
                # subset would pick the tenants that miss out arbitrarily, so none run
                # and the ledger says why until the operator raises the bound.
                unexpanded.append((due, f"fan-out selects {len(tenants)} tenants at the "
                                        f"claim, above the bound of {bound} "
                                        "(serve --max-fan-out)"))
                continue
            for tenant in tenants:
                docs.append({**doc, "_id": tenant_fire_id(due.schedule_id, due.nominal,
                                                          tenant), "tenant": tenant})
        if unexpanded:
            await self._record_unexpanded(unexpanded, term, now)
        revisions = {d.schedule_id: d.revision for d in batch}
        for i in range(0, len(docs), CLAIM_BATCH):
            claimed = await self._claim(docs[i:i + CLAIM_BATCH], term)
            self.metrics.fires.labels("claimed").inc(len(claimed))
            if claimed:
                self._pending.update(c["_id"] for c in claimed)
                task = asyncio.create_task(self._publish_when_due(claimed, revisions, term))
                self._in_flight.add(task)
                task.add_done_callback(self._publish_done)

    def _defer(self, due: Due, fan_out: FanOut, term: int) -> None:
        """Claim ``due`` once its source mirror is in sync (it is loading: a source a
        schedule just started to use, or one resyncing), late rather than lost."""
        fire = fire_id(due.schedule_id, due.nominal)
        if fire in self._deferred:
            return
        self._deferred[fire] = due
        log.info("fan_out_deferred", fire_id=fire, term=term, collection=fan_out.collection)

        async def when_in_sync() -> None:
            assert self.sources is not None
            try:
                wait = (due.fire_at - self.clock()).total_seconds() + SOURCE_SYNC_WAIT_S
                await self.sources.wait_ready(fan_out, max(wait, 0.0))
                if self.lease.valid and self.lease.term == term and self.term == term:
                    await self._claim_and_publish([due], term, self.clock(), may_defer=False)
            except LeadershipLost:
                pass  # nothing claimed: the next leader's catch-up covers it
            except Exception as exc:  # a task of its own: nobody else would see it
                log.error("fan_out_deferred_failed", fire_id=fire, term=term, error=repr(exc))
            finally:
                self._deferred.pop(fire, None)

        task = asyncio.create_task(when_in_sync())
        self._waiting_for_sources.add(task)
        task.add_done_callback(self._waiting_for_sources.discard)

    async def _record_unexpanded(self, dues: list[tuple[Due, str]], term: int,
                                 now: dt.datetime) -> None:
        """A fan-out fire that cannot be expanded (its source mirror is out of sync, or it
        selects more tenants than the bound) is recorded as skipped, saying why, never
        silently dropped."""
        await self.ledger.record_skipped([skipped_range_document(
            d.schedule_id, SkippedRange(d.nominal, d.nominal, 1, reason), term, now)
            for d, reason in dues])
        self.metrics.fires.labels("skipped").inc(len(dues))
        log.warning("fan_out_not_expanded", count=len(dues), term=term, reason=dues[0][1])

    def _publish_done(self, task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("publish_batch_failed", error=repr(task.exception()))

    async def _publish_when_due(self, claimed: list[dict[str, Any]], revisions: dict[str, int],
                                term: int) -> None:
        """Publish each claimed fire at its due time, in groups due together."""
        claimed = sorted(claimed, key=lambda c: c["due_at"])
        try:
            await self._schedule_bodies({c["schedule_id"] for c in claimed})  # warm the cache
            while claimed:
                delay = (claimed[0]["due_at"] - self.clock()).total_seconds()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._handing_over.wait(), delay)
                    if self._handing_over.is_set():
                        return
                now = self.clock()
                due = [c for c in claimed if c["due_at"] <= now]
                claimed = claimed[len(due):]
                if not (self.lease.valid and self.lease.term == term):
                    return  # deposed meanwhile: the next leader adopts these claims
                wanted = await self._still_due(due, revisions, term)
                if wanted:
                    await self._publish(wanted, term, attempt=1)
        finally:
            self._pending.difference_update(c["_id"] for c in claimed)

    async def _still_due(self, due: list[dict[str, Any]], revisions: dict[str, int],
                         term: int) -> list[dict[str, Any]]:
        """The fires still wanted at their due time; the others are recorded as skipped."""
        keep: list[dict[str, Any]] = []
        skipped: dict[str, list[str]] = {}
        # Schedule id -> its fan-out's tenants now (None: the source's mirror is out of sync
        # at this instant; the claim's tenant list stands).
        selected: dict[str, set[str] | None] = {}
        for fire in due:
            self._pending.discard(fire["_id"])
            entry = self.mirror.entries.get(fire["schedule_id"])
            reason = None
            if entry is None:
                reason = "schedule deleted before its due time"
            elif entry.paused:
                reason = "schedule paused before its due time"
            elif entry.revision != revisions[fire["schedule_id"]] and not is_fire_time(
                    entry, fire["nominal_at"]):
                reason = "schedule changed before its due time; no longer a fire time"
            elif "tenant" in fire:
                if entry.fan_out is None:
                    reason = "schedule changed before its due time; it no longer fans out"
                else:
                    if fire["schedule_id"] not in selected:
                        tenants = self.sources.tenants(entry.fan_out) if self.sources else None
                        selected[fire["schedule_id"]] = None if tenants is None \
                            else set(tenants)
                    now_selected = selected[fire["schedule_id"]]
                    if now_selected is not None and fire["tenant"] not in now_selected:
                        reason = "tenant no longer selected at its due time"
            if reason is None:
                keep.append(fire)
            else:
                skipped.setdefault(reason, []).append(fire["_id"])
        for reason, ids in skipped.items():  # one write per reason: a fan-out skips many
            await self.ledger.skip(ids, term, reason)
            self.metrics.fires.labels("skipped").inc(len(ids))
            log.info("skipped_before_due", count=len(ids), term=term, reason=reason)
        return keep

    async def _publish(self, claimed: list[dict[str, Any]], term: int, attempt: int) -> None:
        """Publish claimed fires; mark each published, or schedule its retry."""
        schedules = await self._schedule_bodies({c["schedule_id"] for c in claimed})
        fired_at = iso_utc(self.clock())
        messages, sendable, gone = [], [], []
        for fire in claimed:
            template = schedules.get(fire["schedule_id"])
            if template is None:
                gone.append(fire["_id"])
                continue
            messages.append(template.render(fire, term, attempt, fired_at))
            sendable.append(fire)
        if gone:
            self.metrics.fires.labels("skipped").inc(len(gone))
            await self.ledger.skip(gone, term, "schedule deleted before its fire was published")
        # The slot bounds what awaits the broker; marking below is outside it, so a batch
        # due now never waits for an earlier batch's database round trip.
        async with self._slots:
            self._awaiting_broker += 1
            self._broker_idle.clear()
            try:
                sent = self.clock()
                outcomes = await self.broker.publish(messages, self.settings.publish_timeout_s)
                acked_at = self.clock()
            finally:
                self._awaiting_broker -= 1
                if not self._awaiting_broker:
                    self._broker_idle.set()
        self.metrics.publish_seconds.observe((acked_at - sent).total_seconds())
        done = [f["_id"] for f, error in zip(sendable, outcomes, strict=True) if error is None]
        if done:
            # Marking waits (briefly) for the batches published with this one: with the
            # database, the broker and the leader sharing a machine, the database's work
            # for the first batches slowed the broker's acks of the last ones.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._broker_idle.wait(), MARK_DEFER_MAX_S)
            await self.ledger.mark_published(done, term, acked_at, attempt)
            self.published += len(done)
            self.metrics.fires.labels("published").inc(len(done))
            for fire, error in zip(sendable, outcomes, strict=True):
                if error is None:
                    self.metrics.lateness.observe((acked_at - fire["due_at"]).total_seconds())
            for fire_id in done:
                log.debug("fired", fire_id=fire_id, term=term, attempt=attempt)
        failures = [(f, e) for f, e in zip(sendable, outcomes, strict=True) if e is not None]
        for fire, error in failures:
            await self._record_failure(fire, term, attempt, error)
        if failures:
            log.warning("publish_failed", count=len(failures), term=term, attempt=attempt,
                        error=repr(failures[0][1]))

    async def _schedule_bodies(self, ids: set[str]) -> dict[str, EventTemplate]:
        """The event template (name, target, payload) of each schedule still stored."""
        found: dict[str, EventTemplate] = {}
        for schedule_id in ids:
            entry = self.mirror.entries.get(schedule_id)
            cached = self._bodies.get(schedule_id)
            if entry is not None and cached is not None and cached[0] == entry.revision:
                found[schedule_id] = cached[1]
        missing = list(ids - found.keys())
        if missing:
            async for doc in self.schedules.find({"_id": {"$in": missing}},
                                                 {"name": 1, "payload": 1, "target": 1,
                                                  "revision": 1}):
                template = EventTemplate.of(doc)
                found[doc["_id"]] = template
                self._bodies[doc["_id"]] = (doc.get("revision", 0), template)
        for gone in ids - found.keys():
            self._bodies.pop(gone, None)
        return found

    async def _record_failure(self, fire: dict[str, Any], term: int, attempt: int,
                              error: BaseException) -> None:
        now = self.clock()
        fire_id = fire["_id"]
        # An unavailable broker is no fault of the fire's: it waits and is tried again soon
        # after the broker is back (a stream's election takes seconds), for as long as a
        # republish is still deduplicated (max_unavailable_s < the duplicate window).
        unavailable = isinstance(error, BrokerUnavailable) and (
            now - fire["due_at"]).total_seconds() < self.settings.max_unavailable_s
        if attempt >= self.settings.max_attempts and not unavailable:
            await self.ledger.mark_failed(fire_id, term, attempt, repr(error), now)
            self.metrics.fires.labels("failed").inc()
        else:
            cap = self.settings.unavailable_backoff_cap_s if unavailable \
                else self.settings.backoff_cap_s
            delay = backoff_s(attempt, self.settings.backoff_base_s, cap, random.random())
            await self.ledger.retry_later(fire_id, term, attempt, repr(error),
                                          now + dt.timedelta(seconds=delay))

    # -- retries, takeover, catch-up ------------------------------------------------------

    async def _adopt_claims(self, term: int, grace_s: float) -> int:
        """Take over fires still claimed by older terms (republished: dedup makes it safe).

        ``grace_s`` leaves a deposed leader's just-made claims to its in-flight publish.
        """
        now = self.clock()
        # Not before its due time: a claim made ahead waits for it (_claim takes it then).
        adopted = await self.ledger.adopt_due(term, now, now - dt.timedelta(seconds=grace_s))
        if adopted:
            log.info("adopted_claims", count=adopted, term=term)
        return adopted

    async def _retry_due(self, term: int) -> None:
        # Batch after batch: a burst that waited out a broker outage goes out at once.
        for _ in range(RETRY_BATCHES_PER_TURN):
            batch = await self.ledger.due_for_retry(term, self.clock(), limit=CLAIM_BATCH)
            if batch:
                attempt = max(int(d.get("attempts", 0)) for d in batch) + 1
                await self._publish(batch, term, attempt)
            if len(batch) < CLAIM_BATCH or not self.lease.valid:
                return

    async def _retry_loop(self, term: int) -> None:
        while True:
            await asyncio.sleep(self.settings.retry_interval_s)
            if not self.lease.valid:
                raise LeadershipLost
            await self._adopt_claims(term, grace_s=self.lease.timings.ttl)
            await self._retry_due(term)

    async def _catch_up(self, term: int, since: dt.datetime, now: dt.datetime) -> None:
        # Planned in a thread: counting what a long outage skipped can take a good part of
        # a second for a dense schedule, and the loop must keep renewing the lease.
        entries = [(sid, e) for sid, e in self.mirror.entries.items() if not e.paused]
        to_fire, ranges = await asyncio.to_thread(_plan_catchups, entries, since, now)
        if not self.lease.valid:
            raise LeadershipLost
        skipped = [skipped_range_document(schedule_id, skip, term, now)
                   for schedule_id, skip in ranges]
        await self.ledger.record_skipped(skipped)
        if to_fire or skipped:
            log.info("catching_up", fires=len(to_fire), skipped_ranges=len(skipped),
                     skipped=sum(d["count"] for d in skipped), term=term)
        if to_fire:
            to_fire.sort()
            await self._claim_all(to_fire, term, self.clock())

    async def drain(self) -> None:
        """Let in-flight publishes finish (bounded by the drain timeout); claims not yet
        due are left for the next leader."""
        self._handing_over.set()
        if self._in_flight:
            await asyncio.wait(list(self._in_flight), timeout=self.settings.drain_timeout_s)
