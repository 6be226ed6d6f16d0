"""The firing path: claim fires (each id's insert, once) and publish each at its due time,
through the overlap gate, after a last look that it is still a fire of its schedule
(invariants 4 and 5, docs/ARCHITECTURE.md). Every piece of leader work that fires calls
it: the fire loop, the take-over's catch-up, backfills, a late change's fires.

A fire's id is ``<schedule_id>@<nominal UTC time>``; it is claimed by inserting that id
into ``fires`` (a duplicate key means another leader owns it), and every ledger write
carries the term. Publishing (publishing.py) uses the fire id as the broker's dedup key,
so republishing after a failover is safe. Claims are made up to CLAIM_AHEAD_S before the
due time and re-checked against the mirror when it comes (a schedule paused, deleted or
edited meanwhile is recorded as skipped).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import datetime as dt
from collections.abc import Callable, Mapping
from typing import Protocol

import structlog

from hascheduler.core.catchup import SkippedRange
from hascheduler.core.claims import Claim, expand, none_withdrawn, withdrawn
from hascheduler.core.clock import Clock
from hascheduler.core.constants import SOURCE_SYNC_WAIT_S
from hascheduler.core.entries import Entry, namespace_of
from hascheduler.core.fanout import FanOut
from hascheduler.core.fields import DEFAULT_NAMESPACE
from hascheduler.core.fire_queue import Due
from hascheduler.core.triggers import fire_id
from hascheduler.process.metrics import Metrics
from hascheduler.replica.in_flight import InFlight
from hascheduler.replica.overlap import Fenced
from hascheduler.replica.publishing import DispatchSettings
from hascheduler.replica.term import Term
from hascheduler.storage.fire_records import claim_record, skipped_range_document
from hascheduler.storage.fires import Ledger

log = structlog.get_logger("hascheduler.dispatch")

# Fires claimed (and published) per database round trip, bounded so that one burst never
# holds the database longer than a lease renewal can wait (docs/BENCHMARKS.md).
CLAIM_BATCH = 1000
# Claim batches awaiting the database at once, so that a burst's claims do not wait one
# round trip each behind the other connections' turns.
CLAIMS_IN_FLIGHT = 2
# Fires are claimed up to this long before they are due, and published at their due time
# after a re-check (paused, deleted, edited meanwhile): a burst's claims are then made
# before its second instead of delaying its publishes. Under two seconds, because cron
# fires cluster on whole seconds: the next-but-one second's claims then fall mid-second,
# not at the instant of this second's publish.
# A claim made ahead is published only if its term still holds the lease at the due time.
CLAIM_AHEAD_S = 1.5

# A claimed fire passes the overlap gate (its run reserved) this long before its due
# time, so the reservation's database round trip is not part of its lateness; one whose
# key's run is still open then is asked again at its due time. Long enough for the
# reservations of thousands of fires due together.
ADMIT_AHEAD_S = 0.25

# Fires due within one tick are published together at its end (never before their due
# time): schedules whose phases spread over the second otherwise made a publish, and a
# ledger write, per millisecond, and that overhead, not the fires, capped the rate.
PUBLISH_TICK_S = 0.005
# Waits up to this long are not cut short by a handover (a SIGTERM's drain starts at most
# this much later).
SHORT_WAIT_S = 0.05

# A deferred fan-out fire whose claim failed while its term goes on is taken again this
# much later (put back into the queue, which holds the watermark before it meanwhile).
RETRY_AFTER_S = 0.5


def _due_at(claim: Claim) -> dt.datetime:
    return claim.due_at


def publish_tick(due_at: dt.datetime) -> dt.datetime:
    """The end of the PUBLISH_TICK_S tick ``due_at`` falls in (``due_at`` itself on a
    tick's edge): when a fire due then is published."""
    into = (due_at - _EPOCH) % dt.timedelta(seconds=PUBLISH_TICK_S)
    return due_at if not into else due_at + (dt.timedelta(seconds=PUBLISH_TICK_S) - into)


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


class TenantSource(Protocol):
    """The tenants a fan-out selects now, from the replica's source mirrors (tenants.py);
    None while that source's mirror is not in sync."""

    def tenants(self, fan_out: FanOut) -> list[str] | None: ...

    async def wait_ready(self, fan_out: FanOut, timeout_s: float) -> bool: ...


class Publishing(Protocol):
    """What the firing path asks of the publisher (replica/publishing.py ``Publisher``)
    for the claims it holds until their due time."""

    changes: int  # schedules changed so far: the same count later, none changed between

    async def templates(self, ids: set[str]) -> Mapping[str, object]: ...

    def prepare(self, claims: list[Claim]) -> None: ...

    def discard(self, claims: list[Claim]) -> None: ...

    async def admit(self, claims: list[Claim], term: Fenced) -> tuple[list[Claim], list[Claim]]: ...

    def ready(self, claims: list[Claim], term: int) -> None: ...

    async def unadmit(self, claims: list[Claim], term: int) -> None: ...

    async def publish(self, claims: list[Claim], term: Fenced, attempt: int) -> None: ...

    async def publish_admitted(
        self, claims: list[Claim], term: Fenced, unchanged: bool
    ) -> None: ...


class FiringPath:
    """Claim and publish at the due time, for whichever piece of a term's work fires."""

    def __init__(
        self,
        entries: Mapping[str, Entry],
        ledger: Ledger,
        publisher: Publishing,
        settings: DispatchSettings,
        clock: Clock,
        metrics: Metrics,
        sources: TenantSource | None,
        wake: Callable[[], None],
    ) -> None:
        self.entries = entries  # the mirror's
        self.ledger = ledger
        self.publisher = publisher
        self.settings = settings
        self.clock = clock
        self.metrics = metrics
        self.sources = sources
        self.wake = wake  # the fire loop: a fire put back into the queue is due sooner

    async def claim(
        self, claims: list[Claim], term: Term, now: dt.datetime, backfill: str | None = None
    ) -> list[Claim]:
        """Insert claims; returns those we now own.

        A duplicate key is another term's claim, or one of ours already pending. Another
        term's claim still unpublished was left by a deposed leader (only one lease is
        valid at a time): it is adopted now, at its due time, rather than when the
        periodic adoption comes round.
        """
        if not claims:
            return []
        term.check()
        retry_at = self.retry_at(now)
        docs = [
            claim_record(
                c, term.number, now, retry_at, backfill, namespace_of(self.entries, c.schedule_id)
            )
            for c in claims
        ]
        taken: set[str] = set()
        if min(c.due_at for c in claims) <= term.contested_until:
            # Many are likely claimed already: those found are not inserted.
            taken = await term.read(self.ledger.claimed([d["_id"] for d in docs]))
            docs = [d for d in docs if d["_id"] not in taken]
        if docs:
            taken |= await term.write(self.ledger.claim(docs))
        if not taken:
            return claims
        adopted = await self.adopt(taken - term.pending.keys(), term)
        if adopted:
            log.info("adopted_claims", count=len(adopted), term=term.number, at="due time")
        return [c for c in claims if c.fire_id not in taken or c.fire_id in adopted]

    async def adopt(self, fire_ids: set[str], term: Term) -> set[str]:
        """Those of ``fire_ids`` left unpublished by an older term or this one, taken over
        by this term (Ledger.adopt: one write, where a read before it made a successor's
        takeover wait a round trip more per batch of the fires its predecessor left)."""
        if not fire_ids:
            return set()
        taken: set[str] = await term.write(self.ledger.adopt(fire_ids, term.number, self.clock()))
        return taken

    async def claim_late(
        self, dues: list[Due], term: Term, now: dt.datetime, passed: dt.datetime | None
    ) -> None:
        """Claim fires due before the term (a catch-up's, a late change's). A fan-out's
        instant due by ``passed`` (the watermark an earlier term passed) that the ledger
        holds any claim or record of was handled then, for the tenants selected then: it
        is left out, or a tenant selected since would get a fire of an instant that had
        none for it. One it holds nothing of is claimed for the tenants selected now."""
        term.opened(dues)
        handled: set[tuple[str, dt.datetime]] = set()
        earlier: dict[str, list[dt.datetime]] = {}
        for due in dues:
            entry = self.entries.get(due.schedule_id)
            if (
                entry is not None
                and entry.fan_out is not None
                and passed is not None
                and due.fire_at <= passed
            ):
                earlier.setdefault(due.schedule_id, []).append(due.nominal)
        for schedule_id, nominals in earlier.items():
            held = await term.read(self.ledger.instants_held(schedule_id, nominals))
            handled.update((schedule_id, n) for n in held)
        if handled:
            term.resolved(d for d in dues if (d.schedule_id, d.nominal) in handled)
            dues = [d for d in dues if (d.schedule_id, d.nominal) not in handled]
        await self.claim_all(dues, term, now)

    async def claim_all(self, dues: list[Due], term: Term, now: dt.datetime) -> None:
        """Claim ``dues`` (planned apart from the queue), open until each is claimed."""
        term.opened(dues)
        async with InFlight(CLAIMS_IN_FLIGHT) as claiming:
            for i in range(0, len(dues), CLAIM_BATCH):
                await claiming.start(self.claim_and_publish(dues[i : i + CLAIM_BATCH], term, now))

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
        """Claim ``batch`` (expanded per tenant) and publish what we now own at its due
        time; (claims owned, claims tried). ``overlap`` overrides the schedules' policy;
        ``backfill`` marks the claims a backfill's; ``published`` collects the tasks
        publishing them.
        Each instant is resolved for the term once all its claims are made (or it is
        recorded skipped); one waiting for its fan-out source stays open."""
        sources = self.sources
        expansion = expand(
            batch,
            self.entries,
            sources.tenants if sources is not None else None,
            self.settings.max_fan_out,
            may_defer and sources is not None,
            SOURCE_SYNC_WAIT_S,
        )
        for due, fan_out in expansion.waiting:
            self.defer(due, fan_out, term)
        if expansion.refused:
            await self.record_refused(expansion.refused, term, now, backfill)
        revisions = {d.schedule_id: d.revision for d in batch}
        claims = expansion.claims
        waiting = {(d.schedule_id, d.nominal) for d, _ in expansion.waiting}
        if overlap is not None:
            for claim in claims:
                claim.overlap = overlap
        owned = 0
        for i in range(0, len(claims), CLAIM_BATCH):
            claimed = await self.claim(claims[i : i + CLAIM_BATCH], term, now, backfill)
            self.metrics.fires.labels("claimed").inc(len(claimed))
            self._count_by_namespace(claimed)
            owned += len(claimed)
            if claimed:
                term.add_pending(claimed)
                task = term.start_publishing(self.publish_when_due(claimed, revisions, term))
                if published is not None:
                    published.append(task)
        term.resolved(d for d in batch if (d.schedule_id, d.nominal) not in waiting)
        return owned, len(claims)

    def _count_by_namespace(self, claimed: list[Claim]) -> None:
        entries = self.entries
        counts: dict[str, int] = {}
        for claim in claimed:
            entry = entries.get(claim.schedule_id)
            namespace = entry.namespace if entry is not None else DEFAULT_NAMESPACE
            counts[namespace] = counts.get(namespace, 0) + 1
        for namespace, count in counts.items():
            self.metrics.namespace_fires.labels(namespace).inc(count)

    def defer(self, due: Due, fan_out: FanOut, term: Term) -> None:
        """Claim ``due`` once its source mirror is in sync (it is loading: a source a
        schedule just started to use, or one resyncing), late rather than lost. It stays
        open for the term until claimed or recorded skipped: a claim that fails while the
        term goes on (a write outlasting what remained of the term, then renewed) puts it
        back into the queue, and a term that ends leaves it to the next leader's
        catch-up."""
        fire = fire_id(due.schedule_id, due.nominal)
        if fire in term.deferred:
            return
        term.deferred.add(fire)
        term.opened([due])
        log.info("fan_out_deferred", fire_id=fire, term=term.number, collection=fan_out.collection)

        async def when_in_sync() -> None:
            assert self.sources is not None
            try:
                wait = (due.fire_at - self.clock()).total_seconds() + SOURCE_SYNC_WAIT_S
                await self.sources.wait_ready(fan_out, max(wait, 0.0))
                term.check()
                await self.claim_and_publish([due], term, self.clock(), may_defer=False)
            except Exception as exc:  # a task of its own: nobody else would see it
                if term.active:
                    term.put_back(due, self.clock() + dt.timedelta(seconds=RETRY_AFTER_S))
                    self.wake()
                log.warning(
                    "fan_out_deferred_failed",
                    fire_id=fire,
                    term=term.number,
                    error=repr(exc),
                    again=term.active,
                )
            finally:
                term.deferred.discard(fire)

        term.start_waiting(when_in_sync())

    async def record_refused(
        self, dues: list[tuple[Due, str]], term: Term, now: dt.datetime, backfill: str | None = None
    ) -> None:
        """A fire that cannot go (a fan-out whose source mirror is out of sync or that
        selects more tenants than the bound, a namespace far over its quota) is recorded as
        skipped, saying why, never silently dropped."""
        await term.write(
            self.ledger.record_skipped(
                [
                    skipped_range_document(
                        d.schedule_id,
                        SkippedRange(d.nominal, d.nominal, 1, reason),
                        term.number,
                        now,
                        backfill,
                        namespace_of(self.entries, d.schedule_id),
                    )
                    for d, reason in dues
                ]
            )
        )
        term.resolved(d for d, _ in dues)
        self.metrics.fires.labels("skipped").inc(len(dues))
        log.warning("fires_refused", count=len(dues), term=term.number, reason=dues[0][1])

    async def publish_when_due(
        self, claimed: list[Claim], revisions: dict[str, int], term: Term
    ) -> None:
        """Admit each claimed fire through the overlap gate ADMIT_AHEAD_S before its due
        time, and publish it at its due time, in groups due together."""
        claimed = sorted(claimed, key=_due_at)
        admitted: list[Claim] = []  # through the gate, awaiting their due time
        held: set[str] = set()  # among them, those the gate asks again at their due time
        ahead = dt.timedelta(seconds=ADMIT_AHEAD_S)
        everything = claimed
        try:
            await self.publisher.templates({c.schedule_id for c in claimed})  # warm the cache
            self.publisher.prepare(claimed)
            # Every claim still a fire of its schedule as of this count of changes: at its
            # due time the same count says so again, without a look at each (still_due,
            # which the fires due together at an instant waited for one batch after
            # another).
            checked_at = self.publisher.changes
            verified = none_withdrawn(claimed, self.entries, revisions)
            while claimed or admitted:
                next_at = min(
                    ([claimed[0].due_at - ahead] if claimed else [])
                    + ([publish_tick(admitted[0].due_at)] if admitted else [])
                )
                if not await self._until(next_at, term):
                    return  # handing over: the next leader adopts these claims
                now = self.clock()
                if not term.holds:
                    return  # deposed meanwhile: the next leader adopts these claims
                if claimed and claimed[0].due_at - ahead <= now:
                    # Both lists are in due order: what is due is a prefix, found by
                    # bisection rather than a scan of the rest at every tick.
                    split = bisect.bisect_right(claimed, now + ahead, key=_due_at)
                    coming, claimed = claimed[:split], claimed[split:]
                    passed, again = await self._admit(coming, term)
                    held.update(c.fire_id for c in again)
                    admitted = sorted(admitted + passed + again, key=_due_at)
                    continue
                split = bisect.bisect_right(admitted, now, key=_due_at)
                due, admitted = admitted[:split], admitted[split:]
                try:
                    unchanged = verified and self.publisher.changes == checked_at
                    wanted = due if unchanged else await self.still_due(due, revisions, term)
                    kept = {c.fire_id for c in wanted}
                    withdrawn = [
                        c for c in due if c.fire_id not in kept and c.fire_id not in held
                    ]  # held ones reserved nothing
                    if withdrawn:
                        await self.publisher.unadmit(withdrawn, term.number)
                    through = [c for c in wanted if c.fire_id not in held]
                    if through:
                        await self.publisher.publish_admitted(through, term, unchanged)
                    if len(through) < len(wanted):  # their run was open ahead: asked now
                        await self.publisher.publish(
                            [c for c in wanted if c.fire_id in held], term, attempt=1
                        )
                finally:
                    term.remove_pending(due)
        finally:
            # Every one of them, those being admitted too: one left pending would be
            # passed over by the term's retries for ever, claimed and never published.
            term.remove_pending(everything)
            self.publisher.discard(everything)

    async def _admit(self, coming: list[Claim], term: Term) -> tuple[list[Claim], list[Claim]]:
        """The claims the overlap gate lets through, and those it holds to ask again at
        their due time; the others (recorded skipped or buffered by it) are done with."""
        passed, held = await self.publisher.admit(coming, term)
        kept = {c.fire_id for c in passed} | {c.fire_id for c in held}
        refused = [c for c in coming if c.fire_id not in kept]
        term.remove_pending(refused)
        self.publisher.ready(passed, term.number)
        return passed, held

    async def _until(self, at: dt.datetime, term: Term) -> bool:
        """Wait until ``at``; False if the term began handing over meanwhile."""
        delay = (at - self.clock()).total_seconds()
        if 0 < delay <= SHORT_WAIT_S:
            # A tick's wait: a plain timer, not wait_for's task and its cancellation at
            # every tick of every publishing batch.
            await asyncio.sleep(delay)
        elif delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(term.handing_over.wait(), delay)
        return not term.handing_over.is_set()

    async def still_due(
        self, due: list[Claim], revisions: dict[str, int], term: Term
    ) -> list[Claim]:
        """The fires still wanted at their due time; the others are recorded as skipped."""
        keep: list[Claim] = []
        skipped: dict[str, list[str]] = {}
        # Schedule id -> its fan-out's tenants now (None: the source's mirror is out of sync
        # at this instant; the claim's tenant list stands).
        selected: dict[str, set[str] | None] = {}
        for claim in due:
            entry = self.entries.get(claim.schedule_id)
            reason = withdrawn(claim, entry, revisions[claim.schedule_id])
            if (
                reason is None
                and claim.tenant is not None
                and entry is not None
                and entry.fan_out is not None
            ):
                if claim.schedule_id not in selected:
                    tenants = self.sources.tenants(entry.fan_out) if self.sources else None
                    selected[claim.schedule_id] = None if tenants is None else set(tenants)
                now_selected = selected[claim.schedule_id]
                if now_selected is not None and claim.tenant not in now_selected:
                    reason = "tenant no longer selected at its due time"
            if reason is None:
                keep.append(claim)
            else:
                skipped.setdefault(reason, []).append(claim.fire_id)
        for reason, ids in skipped.items():  # one write per reason: a fan-out skips many
            await term.write(self.ledger.skip(ids, term.number, reason))
            self.metrics.fires.labels("skipped").inc(len(ids))
            log.info("skipped_before_due", count=len(ids), term=term.number, reason=reason)
        return keep

    # -- retries, takeover, catch-up ------------------------------------------------------

    def retry_at(self, now: dt.datetime) -> dt.datetime:
        """When the retry loop takes a claim whose publish has not finished by then."""
        return now + dt.timedelta(seconds=self.settings.publish_timeout_s * 2)
