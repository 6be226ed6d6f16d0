"""The leader's firing engine: claim each due fire once, publish it, mark it published.

Invariants 4 and 5 (docs/ARCHITECTURE.md). Leading is one term (term.py): ``lead`` enters
it, and everything below acts for that term and stops when ``term.check()`` says it no
longer holds the lease. A fire's id is ``<schedule_id>@<nominal UTC time>``; it is claimed
by inserting that id into ``fires`` (a duplicate key means another leader owns it), and
every ledger write carries the term. Publishing (publishing.py) uses the fire id as the
broker's dedup key, so republishing after a failover is safe. Claims are made up to
CLAIM_AHEAD_S before the due time and re-checked against the mirror when it comes (a
schedule paused, deleted or edited meanwhile is recorded as skipped). On becoming leader:
adopt and republish claims left by older terms, then fire what fell due since the previous
leader's watermark, per schedule catch-up policy, recording every skipped time with its
reason; all beside the firing of what falls due from then on.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import datetime as dt
import itertools
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterable, Mapping
from typing import Any, Protocol

import pymongo
import structlog
from pymongo.errors import PyMongoError

from hascheduler.brokers.base import Broker
from hascheduler.core.catchup import SkippedRange, plan_catchup
from hascheduler.core.claims import PAUSED_BEFORE_DUE, Claim, expand
from hascheduler.core.constants import SOURCE_SYNC_WAIT_S
from hascheduler.core.entries import Entry, Written
from hascheduler.core.fanout import FanOut
from hascheduler.core.fire_queue import Due, is_fire_time
from hascheduler.core.instants import as_utc
from hascheduler.core.models import DEFAULT_NAMESPACE
from hascheduler.core.quota import ADMIT, DEFER, FireRates
from hascheduler.core.triggers import (
    count_between,
    fire_id,
    fire_times,
    jitter_offset,
    just_before,
    latest_at_or_before,
)
from hascheduler.process.metrics import Metrics
from hascheduler.replica.backfilling import Backfilling
from hascheduler.replica.overlap import BUFFER_POLL_S, OverlapGate
from hascheduler.replica.publishing import (
    Clock,
    DispatchSettings,
    MirroredSchedules,
    Publisher,
    StoredSchedules,
)
from hascheduler.replica.term import HeldLease, LeadershipLost, Term
from hascheduler.storage.backfills import Backfills
from hascheduler.storage.fire_counts import FireCounts
from hascheduler.storage.fires import REQUESTED, Ledger, claim_record, skipped_range_document
from hascheduler.storage.lease import LeaseView
from hascheduler.storage.runs import RunLedger
from hascheduler.storage.schedules import ScheduleStore

log = structlog.get_logger("hascheduler.dispatch")

# Fires claimed (and published) per database round trip. Bounded so that one burst never
# holds the database longer than a lease renewal can wait: with 10,000 claims in one
# insert, the single-threaded development server starved the leader's renewal past its
# deadline and leadership thrashed mid-burst.
CLAIM_BATCH = 1000
# Claim batches awaiting the database at once: one at a time, each claim's round trip
# waited behind the other connections' turns on a busy server, and a burst's claims fell
# behind their due times while the server had time to spare.
CLAIMS_IN_FLIGHT = 2
# Fires are claimed up to this long before they are due, and published at their due time
# after a re-check (paused, deleted, edited meanwhile): a burst's claims are then made
# before its second instead of delaying its publishes. The claims of 10,000 fires due
# together take about a third of a second of the development server's time. A second and
# a half, not two: cron fires cluster on whole seconds, and claiming the next-but-one
# second's fires then happens mid-second instead of at the instant this second's publish.
# A claim made ahead is published only if its term still holds the lease at the due time.
CLAIM_AHEAD_S = 1.5
# Fires are claimed at most this often on the clock (a schedule changed wakes the loop at
# once): with phases spread over the second, the next fire's claim time is always a
# fraction of a millisecond away, and claiming at each made an insert of a few fires,
# and its round trip, thousands of times a second.
CLAIM_EVERY_S = 0.025
# A change the mirror applies after the loop has passed the instants it makes due (its
# change stream lagging a busy server, its write held up, a schedule written just before a
# term began) is planned from when it was made (replan_from), not from the watermark:
# planned from the watermark, a one-off due in between was never fired, nor a cron's
# first fires. At most this far back: a change applied later than that (a stream resumed
# after an outage) is planned from this far back, as a catch-up window would bound it.
LATE_CHANGE_S = 10.0
# The most instants one schedule's late fires take (a catch-up's of one created just before
# the previous leader's watermark, _plan_catchups; a term's start, late_fires): those of
# LATE_CHANGE_S of a dense trigger.
LATE_FIRES_MAX = 10_000


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

# Retries published per turn of the retry loop, a claim batch each: a 10,000 burst held up
# by a broker outage goes out in one turn, and the loop still yields between batches.
RETRY_BATCHES_PER_TURN = 20
# Retry batches awaiting their publish at once: the fires due now keep the publisher's
# other slots.
RETRIES_IN_FLIGHT = 2
# A deferred fan-out fire whose claim failed while its term goes on is taken again this
# much later (put back into the queue, which holds the watermark before it meanwhile).
RETRY_AFTER_S = 0.5
# How often the leader takes the fires the API asked to run now.
REQUESTED_POLL_S = 0.25
class _InFlight:
    """Tasks ``bound`` at a time: ``start`` waits for a place; leaving the block waits for
    them all, or cancels them if it is left by an error. A task's error (LeadershipLost
    ends the term) is raised at the next ``start`` or on leaving."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self, work: Coroutine[Any, Any, Any]) -> None:
        try:
            await self._fewer_than(self.bound)
        except BaseException:
            work.close()  # never to run
            raise
        self._tasks.add(asyncio.create_task(work))

    async def _fewer_than(self, bound: int) -> None:
        while len(self._tasks) >= bound:
            done, self._tasks = await asyncio.wait(self._tasks,
                                                   return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()

    async def __aenter__(self) -> _InFlight:
        return self

    async def __aexit__(self, error: type[BaseException] | None, *rest: object) -> None:
        try:
            if error is None:
                await self._fewer_than(1)
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)


def change_start(written: Written | None) -> dt.datetime | None:
    """From when a change makes fires due: a new schedule's creation, or its commit."""
    if written is None:
        return None
    return written.created_at if written.created_at is not None else written.at


def replan_from(watermark: dt.datetime | None, written: Written | None
                ) -> dt.datetime | None:
    """Where a changed schedule's fires are planned from: a new schedule from its
    creation, as the catch-up plans one (_plan_catchups: its write may have been held up
    past the watermark, and the instants after its creation are due all the same); a
    change to one from the watermark, or from the commit of a change committed before it;
    either at most LATE_CHANGE_S before the watermark."""
    start = change_start(written)
    if watermark is None or start is None:
        return watermark
    new = written is not None and written.created_at is not None
    if not new and start >= watermark:
        return watermark
    return max(start, watermark - dt.timedelta(seconds=LATE_CHANGE_S))


def _unplanned(entry: Entry | None, written: Written | None, start: dt.datetime,
               planned_from: dt.datetime, lag_s: float) -> SkippedRange | None:
    """The instants of a new schedule whose change was applied later than LATE_CHANGE_S
    that fell due between its creation and where it is planned from, as a skipped range
    (pure); None for a change to a schedule (the leader fired it as it was) or none due."""
    if entry is None or written is None or written.created_at is None or entry.dormant:
        return None
    # Due (jittered) in (start, planned_from]: with jitter, those whose nominal time is
    # surely so (the few in the jitter before planned_from may have been planned).
    until = planned_from - dt.timedelta(seconds=entry.jitter)
    first = next(iter(fire_times(entry.trigger, start, until=until, limit=1)), None)
    last = latest_at_or_before(entry.trigger, start, until)
    if first is None or last is None:
        return None
    return SkippedRange(first, last, count_between(entry.trigger, start, until),
                        f"its creation reached the leader {lag_s:.0f} s late (more than "
                        f"{LATE_CHANGE_S:g} s): its fires before were not planned")


def late_fires(changes: Mapping[str, Written], entries: Mapping[str, Entry],
               now: dt.datetime) -> list[Due]:
    """The fires due by ``now`` of changes applied while a term started (pure): planned
    from when each was made (replan_from), where the term's seed plans them from ``now``.
    A fan-out's too: an instant the ledger holds nothing of, for the tenants it selects
    now (Dispatcher._claim_late)."""
    due: list[Due] = []
    for schedule_id, written in changes.items():
        entry = entries.get(schedule_id)
        start = replan_from(now, written)
        if entry is None or entry.dormant or start is None or start >= now:
            continue
        due += _dues(schedule_id, entry, fire_times(
            entry.trigger, start - dt.timedelta(seconds=entry.jitter), until=now,
            limit=LATE_FIRES_MAX), now, after=start)
    return sorted(due)


def _dues(schedule_id: str, entry: Entry, nominals: Iterable[dt.datetime],
          now: dt.datetime, after: dt.datetime | None = None) -> list[Due]:
    """``nominals`` as fires to claim: those whose jittered time is by ``now`` (and after
    ``after``), and at which the schedule is not paused (until an instant)."""
    due = []
    for nominal in nominals:
        if entry.paused_at(nominal):
            continue
        fire_at = nominal + jitter_offset(schedule_id, nominal, entry.jitter)
        if fire_at <= now and (after is None or fire_at > after):
            due.append(Due(fire_at, nominal, schedule_id, entry.revision))
    return due


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


# How long a term waits for the schedules' creation times before catching up without them
# (a first term reads every schedule's: 1,000,000 take seconds on the development server).
CREATED_READ_S = 60.0


def _plan_catchups(entries: list[tuple[str, Entry]], watermark: dt.datetime | None,
                   now: dt.datetime, created: Mapping[str, dt.datetime]
                   ) -> tuple[list[Due], list[tuple[str, SkippedRange]]]:
    """The schedules' catch-up: the fires due by now (later ones are queued by seeding),
    and the range each skips (pure). Each schedule from the previous leader's
    ``watermark`` (with none, a database's first term, from ``now``), or from its creation
    when ``created`` has it. One created before the watermark (``created`` holds those
    created up to LATE_CHANGE_S before) also fires every instant between its creation and
    it: that leader's watermark may have passed them before it learned of the schedule (a
    write held up, a change stream lagging) and then lost the lease, as a late change's
    are fired (replan_from). Those it did fire keep their one fire: a claim is the fire
    id's insert (a fan-out's instant the ledger holds any claim of is left out,
    Dispatcher._claim_late). A paused one is planned, by its policy, up to its pause's
    start (its instants before were due: the previous leader may have died before it
    fired them) and from its pause's end, if that has come (``until`` is its resume,
    whoever writes the resume and whenever its change comes); a pause from no known
    instant (a write saying ``paused``) covers everything before its end."""
    to_fire: list[Due] = []
    skipped: list[tuple[str, SkippedRange]] = []
    for schedule_id, entry in entries:
        jitter = dt.timedelta(seconds=entry.jitter)
        born = created.get(schedule_id)
        start = (watermark or now) if born is None else born
        late: Iterable[dt.datetime] = ()
        if born is not None and watermark is not None and born < watermark:
            start = watermark  # by its policy from there
            late = fire_times(entry.trigger, born - jitter, until=watermark - jitter,
                              limit=LATE_FIRES_MAX)
        fire: list[dt.datetime] = []
        for since, until in _unpaused(entry, start, now):
            planned, skip = plan_catchup(entry.trigger, entry.catchup, entry.catchup_window,
                                         since - jitter, until)
            fire += planned
            if skip is not None and since == watermark and jitter:
                skip = _less_handled(schedule_id, entry, skip, since)
            if skip is not None:
                skipped.append((schedule_id, skip))
        to_fire += _dues(schedule_id, entry, itertools.chain(late, fire), now)
    return to_fire, skipped


def _less_handled(schedule_id: str, entry: Entry, skip: SkippedRange,
                  watermark: dt.datetime) -> SkippedRange | None:
    """``skip`` less the instants the previous leader handled (pure): a jittered
    schedule's instants with nominal times in the jitter before ``watermark`` whose
    jittered time is by it were fired or recorded skipped by then; planned from
    ``watermark`` less the jitter, they were counted again."""
    handled = {n for n in fire_times(entry.trigger,
                                     watermark - dt.timedelta(seconds=entry.jitter),
                                     until=watermark)
               if skip.first <= n <= skip.last
               and n + jitter_offset(schedule_id, n, entry.jitter) <= watermark}
    if not handled:
        return skip
    count = skip.count - len(handled)
    if count <= 0:
        return None
    first = next(n for n in fire_times(entry.trigger, just_before(skip.first),
                                       until=skip.last) if n not in handled)
    return SkippedRange(first, skip.last, count, skip.reason)


def _unpaused(entry: Entry, start: dt.datetime, now: dt.datetime
              ) -> list[tuple[dt.datetime, dt.datetime]]:
    """The spans of (``start``, ``now``] in which ``entry`` is not paused, each as
    (after, until]: the whole of it, or the part before its pause's start and the part from
    its pause's end (pure)."""
    if not entry.paused:
        return [(start, now)]
    spans = []
    if entry.paused_since is not None and entry.paused_since > start:
        spans.append((start, min(now, just_before(entry.paused_since))))
    if entry.paused_until is not None and entry.paused_until <= now:
        spans.append((max(start, just_before(entry.paused_until)), now))
    return spans


def _withdrawn(claim: Claim, entry: Entry | None, revision: int) -> str | None:
    """Why ``claim``, made when its schedule was at ``revision``, is no longer one of its
    fires as ``entry`` stands (its tenant's selection aside), or None (pure)."""
    if entry is None:
        return "schedule deleted before its due time"
    if entry.completed:
        return "schedule completed (its max_fires fires are used)"
    if entry.paused_at(claim.nominal_at):
        return PAUSED_BEFORE_DUE
    if entry.revision != revision and not is_fire_time(entry, claim.nominal_at):
        return "schedule changed before its due time; no longer a fire time"
    if claim.tenant is not None and entry.fan_out is None:
        return "schedule changed before its due time; it no longer fans out"
    return None


def _none_withdrawn(claims: list[Claim], entries: Mapping[str, Entry],
                    revisions: Mapping[str, int]) -> bool:
    """Whether every one of ``claims``, none a tenant's, is still a fire of its schedule
    as ``entries`` stand (pure): what ``Dispatcher._still_due`` would keep them all for."""
    return all(c.tenant is None and _withdrawn(c, entries.get(c.schedule_id),
                                               revisions[c.schedule_id]) is None
               for c in claims)


class Dispatcher:
    def __init__(self, mirror: MirroredSchedules, schedules: StoredSchedules, ledger: Ledger,
                 broker: Broker, lease: HeldLease, settings: DispatchSettings | None = None,
                 clock: Clock = lambda: dt.datetime.now(dt.UTC),
                 metrics: Metrics | None = None, sources: TenantSource | None = None,
                 runs: RunLedger | None = None, store: ScheduleStore | None = None,
                 counts: FireCounts | None = None, backfills: Backfills | None = None,
                 quota: Callable[[str], float | None] = lambda namespace: None) -> None:
        self.mirror = mirror
        # A namespace's fire-rate quota (the access file's max_fires_per_second), read at
        # each fire so that a change to the file applies at once.
        self.quota = quota
        self.rates = FireRates()
        # Fires given a later slot by their quota, by (schedule, nominal): their slot is
        # reserved, so they go when they come back.
        self.reserved: set[tuple[str, dt.datetime]] = set()
        self.sources = sources
        self.metrics = metrics or Metrics()
        self.ledger = ledger
        self.lease = lease
        self.settings = settings or DispatchSettings()
        self.clock = clock
        self.gate = None if runs is None else OverlapGate(
            ledger, runs, mirror.entries, self.settings.max_buffered, clock, self.metrics)
        self.publisher = Publisher(broker, ledger, mirror, schedules, self.settings, clock,
                                   self.metrics, self.gate, counts, store)
        self.schedules = schedules
        self.store = store
        self.backfilling = None if backfills is None else Backfilling(
            backfills, ledger, mirror.entries, self._claim_and_publish,
            lambda: self.publisher.busy, lambda: self.clock(), CLAIM_AHEAD_S)
        self.term: Term | None = None  # the current term, or the last one
        self._wake = asyncio.Event()
        # Schedules paused until an instant, by id: the leader writes their resume once it
        # has passed (firing honours the instant on its own: Entry.paused_at).
        self.resumes: dict[str, dt.datetime] = {}

    @property
    def fired_through(self) -> dt.datetime | None:
        return self.term.fired_through if self.term is not None else None

    def on_change(self, schedule_id: str, entry: Entry | None,
                  written: Written | None = None) -> None:
        """Called by the mirror for every applied change (made when ``written`` says, for a
        streamed one); reschedules while leading."""
        self.publisher.forget(schedule_id)
        # Paused until an instant before this change: resumed now (by the leader once the
        # instant passed, or by hand), it fires from that instant, not from the resume's
        # commit (the instants between were dropped from the queue as paused).
        until = self.resumes.pop(schedule_id, None)
        if entry is not None and entry.paused and entry.paused_until is not None:
            self.resumes[schedule_id] = entry.paused_until
        term = self.term
        if term is None or not term.active:
            return
        if term.watermark is None and written is not None:
            # The term is starting: its seed plans this from its start, and what fell due
            # before it is claimed once the seed is done (late_fires). The first change
            # of a schedule says when it began to make fires due.
            term.early_changes.setdefault(schedule_id, written)
        since = replan_from(term.watermark, written)
        if until is not None and since is not None and entry is not None and \
                not entry.paused:
            since = min(since, max(just_before(until), term.started_at))
        watermark, start = term.watermark, change_start(written)
        if start is not None and watermark is not None and \
                start < watermark - dt.timedelta(seconds=LATE_CHANGE_S):
            # Its fires between its start and the bound are not fired: say so, and for a
            # new schedule (a changed one's were fired as it was) record them skipped.
            log.warning("change_applied_late", schedule_id=schedule_id, term=term.number,
                        lag_s=round((watermark - start).total_seconds(), 3),
                        planned_from=(since or watermark).isoformat())
            unplanned = _unplanned(entry, written, start, since or watermark,
                                   (watermark - start).total_seconds())
            if unplanned is not None:
                term.waiting(self._record_unplanned(schedule_id, unplanned, term))
        if term.queue.changed(schedule_id, entry, since):
            self._wake.set()

    async def _record_unplanned(self, schedule_id: str, skipped: SkippedRange,
                                term: Term) -> None:
        try:
            await term.write(self.ledger.record_skipped([skipped_range_document(
                schedule_id, skipped, term.number, self.clock())]))
        except LeadershipLost:
            log.warning("unplanned_not_recorded", schedule_id=schedule_id, term=term.number)

    async def lead(self, view: LeaseView) -> None:
        """Fire as the leader of ``view.term`` until cancelled or the term loses the lease."""
        now = self.clock()
        since = view.fired_through  # None: no term of this database has fired yet
        log.info("leading", term=view.term,
                 fired_through=since.isoformat() if since is not None else None)
        async with Term(view.term, self.lease, self.mirror.entries, now) as term:
            if self.term is not None:
                term.follows(self.term)
            self.term = term
            # A term before this one claimed up to CLAIM_AHEAD_S past its last instant
            # (before ours, but for the replicas' clocks' skew: doubled).
            term.contested_until = now + dt.timedelta(seconds=2 * CLAIM_AHEAD_S)
            self.rates, self.reserved = FireRates(), set()
            if self.gate is not None:
                await self.gate.begin()
            self.resumes = {sid: e.paused_until for sid, e in self.mirror.entries.items()
                            if e.paused and e.paused_until is not None}
            # What fell due before the term is taken over beside the firing of what falls
            # due in it (_take_over): behind it, the first new fire waited up to a second.
            term.catching_up, term.taken_over = True, since
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._take_over(term, since, now))
                await self._seed(term, now)
                term.watermark = now
                late = late_fires(term.early_changes, self.mirror.entries, now)
                term.early_changes.clear()
                if late:
                    term.opened(late)  # before the watermark the lease records moves on
                    tasks.create_task(self._claim_late(late, term, now, now))
                tasks.create_task(self._requested_loop(term))
                if self.gate is not None:
                    tasks.create_task(self._release_loop(term, self.gate))
                if self.backfilling is not None:
                    tasks.create_task(self.backfilling.run(term))
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

    async def _seed(self, term: Term, now: dt.datetime) -> None:
        for _ in term.queue.seed(now):
            await asyncio.sleep(0)
            term.check()

    async def _fire_loop(self, term: Term) -> None:
        while True:
            term.check()
            now = self.clock()
            horizon = now + dt.timedelta(seconds=CLAIM_AHEAD_S)
            # A claim batch at a time off the heap (taking 10,000 fires at once held the
            # loop for a fifth of a second), CLAIMS_IN_FLIGHT of them awaiting the database.
            async with _InFlight(CLAIMS_IN_FLIGHT) as claiming:
                while batch := term.take(horizon, CLAIM_BATCH):
                    batch = await self._within_quota(batch, term, now)
                    if batch:
                        await claiming.start(self._claim_and_publish(batch, term, now))
            term.watermark = now
            self._wake.clear()
            wait = 0.25  # re-check the lease at least this often
            first = term.queue.first_at()
            if first is not None:
                ahead = first - dt.timedelta(seconds=CLAIM_AHEAD_S)
                wait = min(wait, max(CLAIM_EVERY_S, (ahead - self.clock()).total_seconds()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    def _count_by_namespace(self, claimed: list[Claim]) -> None:
        entries = self.mirror.entries
        counts: dict[str, int] = {}
        for claim in claimed:
            entry = entries.get(claim.schedule_id)
            namespace = entry.namespace if entry is not None else DEFAULT_NAMESPACE
            counts[namespace] = counts.get(namespace, 0) + 1
        for namespace, count in counts.items():
            self.metrics.namespace_fires.labels(namespace).inc(count)

    async def _within_quota(self, batch: list[Due], term: Term, now: dt.datetime) -> list[Due]:
        """The fires of ``batch`` their namespaces' quotas admit now; the others go back
        into the queue at their slot, or are recorded skipped (core/quota.py)."""
        admitted: list[Due] = []
        skipped: list[tuple[Due, str]] = []
        entries = self.mirror.entries
        for due in batch:
            entry = entries.get(due.schedule_id)
            namespace = entry.namespace if entry is not None else DEFAULT_NAMESPACE
            limit = self.quota(namespace)
            if limit is None or (due.schedule_id, due.nominal) in self.reserved:
                self.reserved.discard((due.schedule_id, due.nominal))
                admitted.append(due)
                continue
            decision, slot = self.rates.decide(namespace, limit, due.fire_at)
            if decision == ADMIT:
                admitted.append(due)
            elif decision == DEFER:
                term.put_back(due, slot)
                self.reserved.add((due.schedule_id, due.nominal))
                self.metrics.quota_deferred.labels(namespace).inc()
            else:
                skipped.append((due, f"namespace {namespace!r} is over its quota of "
                                     f"{limit:g} fires a second (max_fires_per_second)"))
        if skipped:
            await self._record_refused(skipped, term, now)
        return admitted

    async def _claim(self, claims: list[Claim], term: Term, now: dt.datetime,
                     backfill: str | None = None) -> list[Claim]:
        """Insert claims; returns those we now own.

        A duplicate key is another term's claim, or one of ours already pending. Another
        term's claim still unpublished was left by a deposed leader (only one lease is
        valid at a time): it is adopted now, at its due time, rather than when the
        periodic adoption comes round.
        """
        if not claims:
            return []
        term.check()
        retry_at = self._retry_at(now)
        docs = [claim_record(c, term.number, now, retry_at, backfill) for c in claims]
        taken: set[str] = set()
        if min(c.due_at for c in claims) <= term.contested_until:
            # Many are likely claimed already: those found are not inserted.
            taken = await term.read(self.ledger.claimed([d["_id"] for d in docs]))
            docs = [d for d in docs if d["_id"] not in taken]
        if docs:
            taken |= await term.write(self.ledger.claim(docs))
        if not taken:
            return claims
        adopted = await self._adopt(taken - term.pending.keys(), term)
        if adopted:
            log.info("adopted_claims", count=len(adopted), term=term.number, at="due time")
        return [c for c in claims if c.fire_id not in taken or c.fire_id in adopted]

    async def _claim_late(self, dues: list[Due], term: Term, now: dt.datetime,
                          passed: dt.datetime | None) -> None:
        """Claim fires due before the term (a catch-up's, a late change's). A fan-out's
        instant due by ``passed`` (the watermark an earlier term passed) that the ledger
        holds any claim or record of was handled then, for the tenants selected then: it
        is left out, or a tenant selected since would get a fire of an instant that had
        none for it. One it holds nothing of is claimed for the tenants selected now."""
        term.opened(dues)
        handled: set[tuple[str, dt.datetime]] = set()
        earlier: dict[str, list[dt.datetime]] = {}
        for due in dues:
            entry = self.mirror.entries.get(due.schedule_id)
            if entry is not None and entry.fan_out is not None and passed is not None \
                    and due.fire_at <= passed:
                earlier.setdefault(due.schedule_id, []).append(due.nominal)
        for schedule_id, nominals in earlier.items():
            held = await term.read(self.ledger.instants_held(schedule_id, nominals))
            handled.update((schedule_id, n) for n in held)
        if handled:
            term.resolved(d for d in dues if (d.schedule_id, d.nominal) in handled)
            dues = [d for d in dues if (d.schedule_id, d.nominal) not in handled]
        await self._claim_all(dues, term, now)

    async def _claim_all(self, dues: list[Due], term: Term, now: dt.datetime) -> None:
        """Claim ``dues`` (planned apart from the queue), open until each is claimed."""
        term.opened(dues)
        async with _InFlight(CLAIMS_IN_FLIGHT) as claiming:
            for i in range(0, len(dues), CLAIM_BATCH):
                await claiming.start(
                    self._claim_and_publish(dues[i:i + CLAIM_BATCH], term, now))

    async def _claim_and_publish(self, batch: list[Due], term: Term, now: dt.datetime,
                                 may_defer: bool = True, overlap: str | None = None,
                                 backfill: str | None = None,
                                 published: list[asyncio.Task[None]] | None = None
                                 ) -> tuple[int, int]:
        """Claim ``batch`` (expanded per tenant) and publish what we now own at its due
        time; (claims owned, claims tried). ``overlap`` overrides the schedules' policy;
        ``backfill`` marks the claims a backfill's; ``published`` collects the tasks
        publishing them.
        Each instant is resolved for the term once all its claims are made (or it is
        recorded skipped); one waiting for its fan-out source stays open."""
        sources = self.sources
        expansion = expand(batch, self.mirror.entries,
                           sources.tenants if sources is not None else None,
                           self.settings.max_fan_out, may_defer and sources is not None,
                           SOURCE_SYNC_WAIT_S)
        for due, fan_out in expansion.waiting:
            self._defer(due, fan_out, term)
        if expansion.refused:
            await self._record_refused(expansion.refused, term, now, backfill)
        revisions = {d.schedule_id: d.revision for d in batch}
        claims = expansion.claims
        waiting = {(d.schedule_id, d.nominal) for d, _ in expansion.waiting}
        if overlap is not None:
            for claim in claims:
                claim.overlap = overlap
        owned = 0
        for i in range(0, len(claims), CLAIM_BATCH):
            claimed = await self._claim(claims[i:i + CLAIM_BATCH], term, now, backfill)
            self.metrics.fires.labels("claimed").inc(len(claimed))
            self._count_by_namespace(claimed)
            owned += len(claimed)
            if claimed:
                term.claimed(claimed)
                task = term.publishing(self._publish_when_due(claimed, revisions, term))
                if published is not None:
                    published.append(task)
        term.resolved(d for d in batch if (d.schedule_id, d.nominal) not in waiting)
        return owned, len(claims)

    def _defer(self, due: Due, fan_out: FanOut, term: Term) -> None:
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
        log.info("fan_out_deferred", fire_id=fire, term=term.number,
                 collection=fan_out.collection)

        async def when_in_sync() -> None:
            assert self.sources is not None
            try:
                wait = (due.fire_at - self.clock()).total_seconds() + SOURCE_SYNC_WAIT_S
                await self.sources.wait_ready(fan_out, max(wait, 0.0))
                term.check()
                await self._claim_and_publish([due], term, self.clock(), may_defer=False)
            except Exception as exc:  # a task of its own: nobody else would see it
                if term.active:
                    term.put_back(due, self.clock() + dt.timedelta(seconds=RETRY_AFTER_S))
                    self._wake.set()
                log.warning("fan_out_deferred_failed", fire_id=fire, term=term.number,
                            error=repr(exc), again=term.active)
            finally:
                term.deferred.discard(fire)

        term.waiting(when_in_sync())

    async def _record_refused(self, dues: list[tuple[Due, str]], term: Term,
                              now: dt.datetime, backfill: str | None = None) -> None:
        """A fire that cannot go (a fan-out whose source mirror is out of sync or that
        selects more tenants than the bound, a namespace far over its quota) is recorded as
        skipped, saying why, never silently dropped."""
        await term.write(self.ledger.record_skipped([skipped_range_document(
            d.schedule_id, SkippedRange(d.nominal, d.nominal, 1, reason), term.number, now,
            backfill) for d, reason in dues]))
        term.resolved(d for d, _ in dues)
        self.metrics.fires.labels("skipped").inc(len(dues))
        log.warning("fires_refused", count=len(dues), term=term.number, reason=dues[0][1])

    async def _publish_when_due(self, claimed: list[Claim], revisions: dict[str, int],
                                term: Term) -> None:
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
            # due time the same count says so again, without a look at each (_still_due,
            # which the fires due together at an instant waited for one batch after
            # another).
            checked_at = self.publisher.changes
            verified = _none_withdrawn(claimed, self.mirror.entries, revisions)
            while claimed or admitted:
                next_at = min(([claimed[0].due_at - ahead] if claimed else [])
                              + ([publish_tick(admitted[0].due_at)] if admitted else []))
                if not await self._until(next_at, term):
                    return  # handing over: the next leader adopts these claims
                now = self.clock()
                if not term.holds:
                    return  # deposed meanwhile: the next leader adopts these claims
                if claimed and claimed[0].due_at - ahead <= now:
                    # Both lists are in due order: what is due is a prefix, found by
                    # bisection (a scan of the rest at every tick of a spread second
                    # was a twentieth of the leader's time).
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
                    wanted = due if unchanged else await self._still_due(due, revisions, term)
                    kept = {c.fire_id for c in wanted}
                    withdrawn = [c for c in due if c.fire_id not in kept
                                 and c.fire_id not in held]  # held ones reserved nothing
                    if withdrawn:
                        await self.publisher.unadmit(withdrawn, term.number)
                    through = [c for c in wanted if c.fire_id not in held]
                    if through:
                        await self.publisher.publish(through, term, attempt=1,
                                                     admitted=True, unchanged=unchanged)
                    if len(through) < len(wanted):  # their run was open ahead: asked now
                        await self.publisher.publish([c for c in wanted if c.fire_id in held],
                                                     term, attempt=1)
                finally:
                    term.settled(due)
        finally:
            term.settled(claimed + admitted)
            self.publisher.discard(everything)

    async def _admit(self, coming: list[Claim], term: Term
                     ) -> tuple[list[Claim], list[Claim]]:
        """The claims the overlap gate lets through, and those it holds to ask again at
        their due time; the others (recorded skipped or buffered by it) are done with."""
        passed, held = await self.publisher.admit(coming, term)
        kept = {c.fire_id for c in passed} | {c.fire_id for c in held}
        refused = [c for c in coming if c.fire_id not in kept]
        term.settled(refused)
        self.publisher.ready(passed, term.number)
        return passed, held

    async def _until(self, at: dt.datetime, term: Term) -> bool:
        """Wait until ``at``; False if the term began handing over meanwhile."""
        delay = (at - self.clock()).total_seconds()
        if 0 < delay <= SHORT_WAIT_S:
            # A tick's wait: a plain timer (wait_for's task and its cancellation, at every
            # tick of every publishing batch, cost the leader a tenth of its time).
            await asyncio.sleep(delay)
        elif delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(term.handing_over.wait(), delay)
        return not term.handing_over.is_set()

    async def _still_due(self, due: list[Claim], revisions: dict[str, int],
                         term: Term) -> list[Claim]:
        """The fires still wanted at their due time; the others are recorded as skipped."""
        keep: list[Claim] = []
        skipped: dict[str, list[str]] = {}
        # Schedule id -> its fan-out's tenants now (None: the source's mirror is out of sync
        # at this instant; the claim's tenant list stands).
        selected: dict[str, set[str] | None] = {}
        for claim in due:
            entry = self.mirror.entries.get(claim.schedule_id)
            reason = _withdrawn(claim, entry, revisions[claim.schedule_id])
            if reason is None and claim.tenant is not None and entry is not None \
                    and entry.fan_out is not None:
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

    async def _adopt_claims(self, term: Term, grace_s: float) -> int:
        """Take over fires still claimed by older terms, republished: dedup makes it safe.

        ``grace_s`` leaves a deposed leader's just-made claims to its in-flight publish.
        """
        now = self.clock()
        # Not before its due time: a claim made ahead waits for it (_claim takes it then).
        # Made again next turn if it does not finish in this term's time.
        adopted = await term.write_or_defer(self.ledger.adopt_due(
            term.number, now, now - dt.timedelta(seconds=grace_s))) or 0
        if adopted:
            log.info("adopted_claims", count=adopted, term=term.number)
        return adopted

    async def _adopt_left(self, term: Term, now: dt.datetime
                          ) -> AsyncGenerator[list[Claim]]:
        """The claims left unpublished by older terms (and by this term's previous lead,
        if it stopped firing and leads again), due by the start of the term, adopted a
        batch at a time as they are republished, latest due first: the dead leader
        published in due order, so its latest claims are the likeliest unpublished, and
        its earlier ones, mostly published and not yet marked, held them back behind their
        duplicates (and behind adopting them all first). At most a turn of retries' worth:
        the retry loop takes any left beyond it (older terms' by ``_adopt_claims``, this
        term's by ``_retry_due``)."""
        adopted = 0
        async with contextlib.aclosing(self.ledger.left_due(
                term.number, now, CLAIM_BATCH * RETRY_BATCHES_PER_TURN,
                CLAIM_BATCH)) as batches:
            async for batch in batches:
                taken = await self._adopt({c.fire_id for c in batch}, term)
                adopted += len(taken)
                if taken:
                    yield [c for c in batch if c.fire_id in taken]
        if adopted:
            log.info("adopted_claims", count=adopted, term=term.number)

    async def _adopt(self, fire_ids: set[str], term: Term) -> set[str]:
        """Those of ``fire_ids`` left unpublished by an older term or this one, taken over
        by this term (Ledger.adopt: one write, where a read before it made a successor's
        takeover wait a round trip more per batch of the fires its predecessor left)."""
        if not fire_ids:
            return set()
        taken: set[str] = await term.write(
            self.ledger.adopt(fire_ids, term.number, self.clock()))
        return taken

    async def _retry_due(self, term: Term) -> None:
        """A turn of retries, up to RETRY_BATCHES_PER_TURN batches."""
        await self._republish(term, self.ledger.due_for_retry(
            term.number, self.clock(), CLAIM_BATCH * RETRY_BATCHES_PER_TURN, CLAIM_BATCH))

    async def _republish(self, term: Term, batches: AsyncGenerator[list[Claim]]) -> None:
        """Each batch published as it is read, not after the batch before it (a new
        leader's adopted claims, thousands, are among its first fires after a crash); done
        once their marks are written, or the next turn of retries would take them again."""
        async with contextlib.aclosing(batches), \
                _InFlight(RETRIES_IN_FLIGHT) as publishing:
            async for batch in batches:
                # One the term is publishing already (a catch-up's claim that took it over
                # at its due time, a retry read while its publish is in flight) is left to
                # that publish: two at once decided apart at the overlap gate, one
                # reserving its run and the other recording it skipped.
                fresh = [c for c in batch if c.fire_id not in term.pending]
                if fresh:
                    term.claimed(fresh)
                    await publishing.start(self._publish_pending(fresh, term))
                if not term.holds:
                    break
        await self.publisher.marked()

    async def _publish_pending(self, claims: list[Claim], term: Term) -> None:
        try:
            attempt = max(c.attempts for c in claims) + 1
            await self.publisher.publish(claims, term, attempt)
        finally:
            term.settled(claims)

    async def _take_over(self, term: Term, since: dt.datetime | None, now: dt.datetime
                         ) -> None:
        """The claims left by the terms before adopted and republished, then the catch-up
        of what fell due since the previous leader's watermark (the lease records that
        watermark until it is done), then the retry loop."""
        await self._republish(term, self._adopt_left(term, now))
        await self._catch_up(term, since, now)
        term.catching_up = False
        await self._retry_loop(term)

    async def _retry_loop(self, term: Term) -> None:
        while True:
            await asyncio.sleep(self.settings.retry_interval_s)
            term.check()
            await self._adopt_claims(term, grace_s=self.lease.timings.ttl)
            await self._retry_due(term)

    def _retry_at(self, now: dt.datetime) -> dt.datetime:
        """When the retry loop takes a claim whose publish has not finished by then."""
        return now + dt.timedelta(seconds=self.settings.publish_timeout_s * 2)

    async def _requested_loop(self, term: Term) -> None:
        """Fires run now (POST /schedules/{id}/trigger): claimed and published as they
        come. One claimed by a deposed leader is adopted like any claim. And the resume of
        schedules paused until an instant now passed."""
        while True:
            await asyncio.sleep(REQUESTED_POLL_S)
            term.check()
            await self._resume_ended_pauses()
            ids = await self.ledger.requested(CLAIM_BATCH)
            if ids:
                now = self.clock()
                await term.write(self.ledger.take(ids, REQUESTED, term.number, now,
                                                  self._retry_at(now)))
                claims = await term.read(self.ledger.taken(ids, term.number))
                log.info("running_now", count=len(claims), term=term.number)
                term.claimed(claims)  # its retries leave them to this publish
                try:
                    await self.publisher.publish(claims, term, attempt=1)
                finally:
                    term.settled(claims)

    async def _resume_ended_pauses(self) -> None:
        if self.store is None or not self.resumes:
            return
        now = self.clock()
        for schedule_id, until in [(s, u) for s, u in self.resumes.items() if u <= now]:
            if await self.store.resume_at_end(schedule_id, until, now):
                log.info("pause_ended", schedule_id=schedule_id, until=until.isoformat())
            self.resumes.pop(schedule_id, None)

    async def _release_loop(self, term: Term, gate: OverlapGate) -> None:
        """Buffered fires whose schedule's open run has ended: published at once."""
        while True:
            await asyncio.sleep(BUFFER_POLL_S)
            term.check()
            claims = await gate.ready(term, self._retry_at(self.clock()))
            if claims:
                log.info("released_buffered", count=len(claims), term=term.number)
                term.claimed(claims)  # its retries leave them to this publish
                try:
                    await self.publisher.publish(claims, term, attempt=1,
                                                 released=True)
                finally:
                    term.settled(claims)
                    gate.released(claims)

    async def _created_after(self, term: Term, since: dt.datetime | None
                             ) -> dict[str, dt.datetime]:
        """When each schedule written after ``since`` (every one, with none) was created:
        a range of the ``created_at`` index, on dates only (a stored value of another type
        matches nothing). Not one of the term's reads, bound to its lease: in a first term
        it reads every schedule, which on a large database outlasts a few ttls, and the
        term would stop and lead again for ever. Unread within CREATED_READ_S, or failed,
        each schedule is caught up from ``since`` (or the term's start), as it was before
        creation times were read, and a warning says so."""
        after = since or dt.datetime.min.replace(tzinfo=dt.UTC)
        began = time.monotonic()
        try:
            with pymongo.timeout(CREATED_READ_S):
                created = {doc["_id"]: as_utc(doc["created_at"])
                           async for doc in self.schedules.find(
                               {"created_at": {"$gt": after}}, {"created_at": 1})}
        except PyMongoError as exc:
            log.warning("creation_times_unread", error=str(exc)[:300], term=term.number)
            return {}
        log.info("creation_times_read", schedules=len(created), first_term=since is None,
                 seconds=round(time.monotonic() - began, 3), term=term.number)
        return created

    async def _catch_up(self, term: Term, since: dt.datetime | None, now: dt.datetime
                        ) -> None:
        """What fell due in (since, now] and no leader fired, by each schedule's catch-up
        policy; a schedule written after ``since`` from its creation on (before it, nothing
        was due), one written up to LATE_CHANGE_S before it also from its creation
        (_plan_catchups), and with no ``since`` (a database's first term) every schedule
        from its creation."""
        created = await self._created_after(
            term, None if since is None else since - dt.timedelta(seconds=LATE_CHANGE_S))
        term.check()
        # Planned in a thread: counting what a long outage skipped can take a good part of
        # a second for a dense schedule, and the loop must keep renewing the lease.
        entries = [(sid, e) for sid, e in self.mirror.entries.items() if not e.completed]
        to_fire, ranges = await asyncio.to_thread(_plan_catchups, entries, since, now,
                                                  created)
        term.check()
        skipped = [skipped_range_document(schedule_id, skip, term.number, now)
                   for schedule_id, skip in ranges]
        await term.write(self.ledger.record_skipped(skipped))
        if to_fire or skipped:
            log.info("catching_up", fires=len(to_fire), skipped_ranges=len(skipped),
                     skipped=sum(d["count"] for d in skipped), term=term.number)
        if to_fire:
            to_fire.sort()
            await self._claim_late(to_fire, term, self.clock(), since)
