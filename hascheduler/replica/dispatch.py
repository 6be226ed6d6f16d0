"""The leader's dispatcher: it follows the mirror's changes into the term's queue and, while
leading, runs the term (term.py): the fire loop, which takes due fires off the queue a
batch at a time through the quotas (quotas.py) to the firing path (firing.py), and the
term's services beside it, started and stopped with it: take-over (adopt, catch up,
retry: takeover.py), requests (run now, ended pauses: requests.py), overlap release
(release.py) and backfills (backfilling.py). Invariants 4 and 5, docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from hascheduler.brokers.base import Broker
from hascheduler.core.catchup import (
    LATE_CHANGE_S,
    SkippedRange,
    change_start,
    late_fires,
    replan_from,
    unplanned,
)
from hascheduler.core.clock import Clock
from hascheduler.core.entries import Entry, Written, namespace_of
from hascheduler.core.triggers import just_before
from hascheduler.process.metrics import Metrics
from hascheduler.replica.backfilling import Backfilling
from hascheduler.replica.firing import (
    CLAIM_AHEAD_S,
    CLAIM_BATCH,
    CLAIMS_IN_FLIGHT,
    FiringPath,
    TenantSource,
)
from hascheduler.replica.in_flight import InFlight
from hascheduler.replica.overlap import OverlapGate
from hascheduler.replica.publishing import (
    DispatchSettings,
    MirroredSchedules,
    Publisher,
)
from hascheduler.replica.quotas import QuotaAdmission
from hascheduler.replica.release import OverlapRelease
from hascheduler.replica.requests import Requests
from hascheduler.replica.takeover import TakeOver
from hascheduler.replica.term import HeldLease, LeadershipLost, Term, TermService
from hascheduler.storage.backfills import Backfills
from hascheduler.storage.fire_counts import FireCounts
from hascheduler.storage.fire_records import skipped_range_document
from hascheduler.storage.fires import Ledger
from hascheduler.storage.lease import LeaseView
from hascheduler.storage.runs import RunLedger
from hascheduler.storage.schedules import ScheduleStore

log = structlog.get_logger("hascheduler.dispatch")

# Fires are claimed at most this often on the clock (a schedule changed wakes the loop at
# once): with phases spread over the second, the next fire's claim time is always a
# fraction of a millisecond away, and claiming at each made an insert of a few fires,
# and its round trip, thousands of times a second.
CLAIM_EVERY_S = 0.025
# How long one read of which schedules were created after a term's start may take (read
# again until it is, ahead of the seed): an index range, nearly always empty.
AHEAD_READ_S = 1.0


@dataclass(frozen=True, slots=True)
class LeaderStores:
    """What a term's work reads and writes: the fire ledger, the runs ledger (overlap
    policies), the schedules (run-now requests, pause-until resumes, max_fires
    completions, messages' fields), the max_fires counts and the backfills."""

    ledger: Ledger
    runs: RunLedger
    store: ScheduleStore
    counts: FireCounts
    backfills: Backfills


class Dispatcher:
    def __init__(
        self,
        mirror: MirroredSchedules,
        stores: LeaderStores,
        broker: Broker,
        lease: HeldLease,
        settings: DispatchSettings | None = None,
        clock: Clock = lambda: dt.datetime.now(dt.UTC),
        metrics: Metrics | None = None,
        sources: TenantSource | None = None,
        quota: Callable[[str], float | None] = lambda namespace: None,
        services: Sequence[TermService] = (),
    ) -> None:
        self.mirror = mirror
        self.ledger = ledger = stores.ledger
        self.lease = lease
        self.settings = settings = settings or DispatchSettings()
        self.clock = clock
        metrics = metrics or Metrics()
        self.gate = OverlapGate(
            ledger, stores.runs, mirror.entries, settings.max_buffered, clock, metrics
        )
        self.publisher = Publisher(
            broker, ledger, mirror, stores.store, self.gate, stores.counts, settings, clock, metrics
        )
        self._wake = asyncio.Event()
        self.firing = FiringPath(
            mirror.entries,
            ledger,
            self.publisher,
            settings,
            clock,
            metrics,
            sources,
            self._wake.set,
        )
        self.quotas = QuotaAdmission(quota, mirror.entries, self.firing, metrics)
        self.takeover = TakeOver(
            self.firing,
            ledger,
            self.publisher,
            stores.store,
            mirror.entries,
            settings.retry_interval_s,
            lease,
            clock,
        )
        self.requests = Requests(ledger, self.publisher, stores.store, self.firing, clock)
        # The term's services beside the fire loop and the take-over (and those of other
        # parts of the replica: the leader's half of webhooks).
        self.services: list[TermService] = [
            self.requests,
            *services,
            OverlapRelease(self.gate, self.publisher, self.firing, clock),
            Backfilling(
                stores.backfills,
                ledger,
                mirror.entries,
                self.firing.claim_and_publish,
                lambda: self.publisher.busy,
                lambda: self.clock(),
                CLAIM_AHEAD_S,
            ),
        ]
        self.term: Term | None = None  # the current term, or the last one

    @property
    def fired_through(self) -> dt.datetime | None:
        return self.term.fired_through if self.term is not None else None

    def on_change(
        self, schedule_id: str, entry: Entry | None, written: Written | None = None
    ) -> None:
        """Called by the mirror for every applied change (made when ``written`` says, for a
        streamed one); reschedules while leading."""
        self.publisher.forget(schedule_id)
        # Paused until an instant before this change: resumed now (by the leader once the
        # instant passed, or by hand), it fires from that instant, not from the resume's
        # commit (the instants between were dropped from the queue as paused).
        until = self.requests.changed(schedule_id, entry)
        term = self.term
        if term is None or not term.active:
            return
        if term.watermark is None and written is not None:
            # The term is starting: its seed plans this from its start (or from its
            # creation, if later), and what fell due before it is claimed once the seed
            # is done (late_fires). The first change of a schedule says when it began to
            # make fires due.
            term.note_early_change(schedule_id, written)
        since = replan_from(term.watermark, written)
        if until is not None and since is not None and entry is not None and not entry.paused:
            since = min(since, max(just_before(until), term.started_at))
        watermark, start = term.watermark, change_start(written)
        if (
            start is not None
            and watermark is not None
            and start < watermark - dt.timedelta(seconds=LATE_CHANGE_S)
        ):
            # Its fires between its start and the bound are not fired: say so, and for a
            # new schedule (a changed one's were fired as it was) record them skipped.
            log.warning(
                "change_applied_late",
                schedule_id=schedule_id,
                term=term.number,
                lag_s=round((watermark - start).total_seconds(), 3),
                planned_from=(since or watermark).isoformat(),
            )
            skipped = unplanned(
                entry, written, start, since or watermark, (watermark - start).total_seconds()
            )
            if skipped is not None:
                term.start_waiting(self._record_unplanned(schedule_id, skipped, term))
        if term.queue.changed(schedule_id, entry, since):
            self._wake.set()

    async def _record_unplanned(self, schedule_id: str, skipped: SkippedRange, term: Term) -> None:
        try:
            await term.write(
                self.ledger.record_skipped(
                    [
                        skipped_range_document(
                            schedule_id,
                            skipped,
                            term.number,
                            self.clock(),
                            None,
                            namespace_of(self.mirror.entries, schedule_id),
                        )
                    ]
                )
            )
        except LeadershipLost:
            log.warning("unplanned_not_recorded", schedule_id=schedule_id, term=term.number)

    async def lead(self, view: LeaseView) -> None:
        """Fire as the leader of ``view.term`` until cancelled or the term loses the lease:
        the fire loop, and every service of the term beside it in one task group, so that
        all stop together when the term ends."""
        now = self.clock()
        since = view.fired_through  # None: no term of this database has fired yet
        log.info(
            "leading",
            term=view.term,
            fired_through=since.isoformat() if since is not None else None,
        )
        async with Term(view.term, self.lease, self.mirror.entries, now) as term:
            if self.term is not None:
                term.follows(self.term)
            self.term = term
            # A term before this one claimed up to CLAIM_AHEAD_S past its last instant
            # (before ours, but for the replicas' clocks' skew: doubled).
            term.contest_until(now + dt.timedelta(seconds=2 * CLAIM_AHEAD_S))
            self.quotas.begin()
            await self.gate.begin()
            self.requests.begin(self.mirror.entries)
            # What fell due before the term is taken over beside the firing of what falls
            # due in it (TakeOver): behind it, the first new fire waited up to a second.
            term.take_over(since)
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self.takeover.run(term))
                # A schedule stamped as created after ``now`` by a replica whose clock
                # bound ran ahead of ours is planned from its stamp: the audit's rule.
                ahead = await self.takeover.created_after(term, now, AHEAD_READ_S)
                await self._seed(term, now, ahead)
                term.advance(now)
                late = late_fires(term.take_early_changes(), self.mirror.entries, now)
                if late:
                    term.opened(late)  # before the watermark the lease records moves on
                    tasks.create_task(self.firing.claim_late(late, term, now, now))
                for service in self.services:
                    tasks.create_task(service.run(term))
                await self._fire_loop(term)

    def hand_over(self) -> None:
        """The handover begins: the last term's publishes drain (Term.holds keeps it
        acting, its lead cancelled, until the lease is released)."""
        if self.term is not None:
            self.term.handing_over.set()

    async def drain(self) -> bool:
        """The handover: the last term's publishes in flight finish (bounded by the drain
        timeout); its claims not yet due are left for the next leader. True when the lease
        may be released (``settle``)."""
        if self.term is None:
            return True
        began = time.monotonic()
        await self.term.drain(self.settings.drain_timeout_s)
        # Marked before the next leader looks: a fire left claimed is republished.
        left = self.settings.drain_timeout_s - (time.monotonic() - began)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.publisher.marked(), max(left, 0.001))
        return await self.settle(self.settings.drain_timeout_s - (time.monotonic() - began))

    async def settle(self, timeout_s: float) -> bool:
        """True once every ledger write of the last term has had its answer (at most
        ``timeout_s``): released after that, the lease cannot see one land where the next
        term may act. False: let the lease lapse instead (its margin covers the rest)."""
        return self.term is None or await self.term.settle(timeout_s)

    async def _seed(
        self, term: Term, now: dt.datetime, created_since: dict[str, dt.datetime]
    ) -> None:
        for _ in term.queue.seed(now, term.early_changes, created_since):
            await asyncio.sleep(0)
            term.check()

    async def _fire_loop(self, term: Term) -> None:
        while True:
            term.check()
            now = self.clock()
            horizon = now + dt.timedelta(seconds=CLAIM_AHEAD_S)
            # A claim batch at a time off the heap, so a burst never holds the loop,
            # CLAIMS_IN_FLIGHT of them awaiting the database.
            async with InFlight(CLAIMS_IN_FLIGHT) as claiming:
                while batch := term.take(horizon, CLAIM_BATCH):
                    batch = await self.quotas.admit(batch, term, now)
                    if batch:
                        await claiming.start(self.firing.claim_and_publish(batch, term, now))
            term.advance(now)
            self._wake.clear()
            wait = 0.25  # re-check the lease at least this often
            first = term.queue.first_at()
            if first is not None:
                ahead = first - dt.timedelta(seconds=CLAIM_AHEAD_S)
                wait = min(wait, max(CLAIM_EVERY_S, (ahead - self.clock()).total_seconds()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)
