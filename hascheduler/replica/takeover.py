"""Take-over: a term's first work beside the fire loop, then its retries (invariant 5,
docs/ARCHITECTURE.md). The claims older terms left unpublished are adopted and
republished (dedup makes it safe), then what fell due since the previous leader's
watermark is caught up by each schedule's catch-up policy, every time not fired recorded
skipped with its reason; from then on, the retry loop republishes this term's claims whose
publish failed and adopts claims a deposed leader left since."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import AsyncGenerator, Mapping

import pymongo
import structlog
from pymongo.errors import PyMongoError
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from hascheduler.core.catchup import LATE_CHANGE_S, plan_catchups
from hascheduler.core.claims import Claim
from hascheduler.core.clock import Clock
from hascheduler.core.entries import Entry, namespace_of
from hascheduler.replica.firing import CLAIM_BATCH, FiringPath
from hascheduler.replica.in_flight import InFlight
from hascheduler.replica.publishing import Publisher
from hascheduler.replica.term import HeldLease, Term
from hascheduler.storage.fire_records import skipped_range_document
from hascheduler.storage.fires import Ledger
from hascheduler.storage.schedules import ScheduleStore

log = structlog.get_logger("hascheduler.dispatch")

# Retries published per turn of the retry loop, a claim batch each: a burst held up by a
# broker outage goes out in one turn, and the loop still yields between batches.
RETRY_BATCHES_PER_TURN = 20
# Retry batches awaiting their publish at once: the fires due now keep the publisher's
# other slots.
RETRIES_IN_FLIGHT = 2
# How long one read of the schedules' creation times may take (a first term reads every
# schedule's, which takes seconds for a large database), and the longest wait between two.
CREATED_READ_S = 60.0
CREATED_RETRY_MAX_S = 2.0


class TakeOver:
    def __init__(
        self,
        firing: FiringPath,
        ledger: Ledger,
        publisher: Publisher,
        store: ScheduleStore,
        entries: Mapping[str, Entry],
        retry_interval_s: float,
        lease: HeldLease,
        clock: Clock,
    ) -> None:
        self.firing = firing
        self.ledger = ledger
        self.publisher = publisher
        self.store = store
        self.entries = entries  # the mirror's
        self.retry_interval_s = retry_interval_s
        # A deposed leader's claims younger than a lease ttl are left to its publish.
        self.lease = lease
        self.clock = clock

    async def run(self, term: Term) -> None:
        """The claims left by the terms before adopted and republished, then the catch-up
        of what fell due since the previous leader's watermark (the lease records that
        watermark until it is done), then the retry loop."""
        await self.republish(term, self._adopt_left(term, term.started_at))
        await self._catch_up(term, term.taken_over, term.started_at)
        term.caught_up()
        await self._retry_loop(term)

    async def _adopt_left(self, term: Term, now: dt.datetime) -> AsyncGenerator[list[Claim]]:
        """The claims left unpublished by older terms (and by this term's previous lead,
        if it stopped firing and leads again), due by the start of the term, adopted a
        batch at a time as they are republished, latest due first: the dead leader
        published in due order, so its latest claims are the likeliest unpublished, and
        its earlier ones, mostly published and not yet marked, held them back behind their
        duplicates (and behind adopting them all first). At most a turn of retries' worth:
        the retry loop takes any left beyond it (older terms' by ``_adopt_claims``, this
        term's by ``retry_due``)."""
        adopted = 0
        async with contextlib.aclosing(
            self.ledger.left_due(
                term.number, now, CLAIM_BATCH * RETRY_BATCHES_PER_TURN, CLAIM_BATCH
            )
        ) as batches:
            async for batch in batches:
                taken = await self.firing.adopt({c.fire_id for c in batch}, term)
                adopted += len(taken)
                if taken:
                    yield [c for c in batch if c.fire_id in taken]
        if adopted:
            log.info("adopted_claims", count=adopted, term=term.number)

    async def _adopt_claims(self, term: Term, grace_s: float) -> int:
        """Take over fires still claimed by older terms, republished: dedup makes it safe.

        ``grace_s`` leaves a deposed leader's just-made claims to its in-flight publish.
        """
        now = self.clock()
        # Not before its due time: a claim made ahead waits for it (the firing path takes it then).
        # Made again next turn if it does not finish in this term's time.
        adopted = (
            await term.write_or_defer(
                self.ledger.adopt_due(term.number, now, now - dt.timedelta(seconds=grace_s))
            )
            or 0
        )
        if adopted:
            log.info("adopted_claims", count=adopted, term=term.number)
        return adopted

    async def _retry_loop(self, term: Term) -> None:
        while True:
            await asyncio.sleep(self.retry_interval_s)
            term.check()
            await self._adopt_claims(term, grace_s=self.lease.timings.ttl)
            await self.retry_due(term)

    async def retry_due(self, term: Term) -> None:
        """A turn of retries, up to RETRY_BATCHES_PER_TURN batches."""
        await self.republish(
            term,
            self.ledger.due_for_retry(
                term.number, self.clock(), CLAIM_BATCH * RETRY_BATCHES_PER_TURN, CLAIM_BATCH
            ),
        )

    async def republish(self, term: Term, batches: AsyncGenerator[list[Claim]]) -> None:
        """Each batch published as it is read, not after the batch before it (a new
        leader's adopted claims, thousands, are among its first fires after a crash); done
        once their marks are written, or the next turn of retries would take them again."""
        async with contextlib.aclosing(batches), InFlight(RETRIES_IN_FLIGHT) as publishing:
            async for batch in batches:
                # One the term is publishing already (a catch-up's claim that took it over
                # at its due time, a retry read while its publish is in flight) is left to
                # that publish: two at once decided apart at the overlap gate, one
                # reserving its run and the other recording it skipped.
                fresh = [c for c in batch if c.fire_id not in term.pending]
                if fresh:
                    term.add_pending(fresh)
                    await publishing.start(self._publish_pending(fresh, term))
                if not term.holds:
                    break
        await self.publisher.marked()

    async def _publish_pending(self, claims: list[Claim], term: Term) -> None:
        try:
            attempt = max(c.attempts for c in claims) + 1
            await self.publisher.publish(claims, term, attempt)
        finally:
            term.remove_pending(claims)

    async def _catch_up(self, term: Term, since: dt.datetime | None, now: dt.datetime) -> None:
        """What fell due in (since, now] and no leader fired, by each schedule's catch-up
        policy; a schedule written after ``since`` from its creation on (before it, nothing
        was due), one written up to LATE_CHANGE_S before it also from its creation
        (plan_catchups), and with no ``since`` (a database's first term) every schedule
        from its creation."""
        # The schedules as they stand before the read: one the mirror applies while it
        # runs may be missing from it, and is planned from its creation by its change
        # (Dispatcher.on_change), not from ``since`` here.
        entries = [(sid, e) for sid, e in self.entries.items() if not e.completed]
        created = await self.created_after(
            term,
            None if since is None else since - dt.timedelta(seconds=LATE_CHANGE_S),
            CREATED_READ_S,
        )
        term.check()
        # Planned in a thread: counting what a long outage skipped can take a good part of
        # a second for a dense schedule, and the loop must keep renewing the lease.
        to_fire, ranges = await asyncio.to_thread(plan_catchups, entries, since, now, created)
        term.check()
        skipped = [
            skipped_range_document(
                schedule_id, skip, term.number, now, None, namespace_of(self.entries, schedule_id)
            )
            for schedule_id, skip in ranges
        ]
        await term.write(self.ledger.record_skipped(skipped))
        if to_fire or skipped:
            log.info(
                "catching_up",
                fires=len(to_fire),
                skipped_ranges=len(skipped),
                skipped=sum(d["count"] for d in skipped),
                term=term.number,
            )
        if to_fire:
            to_fire.sort()
            await self.firing.claim_late(to_fire, term, self.clock(), since)

    async def created_after(
        self, term: Term, since: dt.datetime | None, within_s: float
    ) -> dict[str, dt.datetime]:
        """When each schedule created after ``since`` (every one, with none) was created,
        read again until it is, while the term holds: planned without it, a schedule
        created after ``since`` would fire the instants before its creation. Each attempt
        is bounded from ``within_s`` on, not by the term's lease: in a first term it reads
        every schedule, which on a large database outlasts a few ttls."""
        after = since or dt.datetime.min.replace(tzinfo=dt.UTC)
        began = time.monotonic()
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(PyMongoError),
            wait=wait_exponential(multiplier=0.1, max=CREATED_RETRY_MAX_S),
            before_sleep=lambda state: log.warning(
                "creation_times_unread",
                error=str(state.outcome.exception() if state.outcome else None)[:300],
                attempt=state.attempt_number,
                term=term.number,
            ),
        ):
            with attempt:
                term.check()
                # Each bound twice the last: a read longer than the first still ends.
                tries = attempt.retry_state.attempt_number
                with pymongo.timeout(within_s * 2 ** min(tries - 1, 5)):
                    created = await self.store.created_after(after)
        log.info(
            "creation_times_read",
            schedules=len(created),
            first_term=since is None,
            seconds=round(time.monotonic() - began, 3),
            term=term.number,
        )
        return created
