"""One leadership term as one object (after River's ``leadershipTerm``): what belongs to a
term is made when it begins and dropped when it ends, and "may this term still act?" is
asked of it alone (``check``: the fence, invariants 3 and 4, docs/ARCHITECTURE.md).

A term owns its number, the watermark (every fire due up to it is handled), the queue of
fires waiting for their due time, the instants taken off it and not yet claimed or recorded
skipped (``open``), the fires claimed and not yet published, and the tasks publishing its
claims. The one rule of the watermark the lease records (``fired_through``, invariant 5):
an instant falls behind it only once it is claimed or recorded skipped, so every path that
takes an instant off the queue takes it through ``take``, and gives it back by ``resolved``
or ``put_back``. Entering the term (``async with``) begins it; leaving it stops everything
that would claim more (the queue is emptied, the waits for sources cancelled: what was not
claimed stays open, so the next leader's catch-up covers it). ``drain`` is the handover:
publishes in flight finish (bounded), claims not yet due are left for the next leader,
which adopts them; ``settle`` says whether every write of the term has had its answer, so
the lease may be released.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections import Counter
from collections.abc import Coroutine, Iterable, Mapping
from typing import Any, Protocol, TypeVar

import pymongo
import structlog
from pymongo.errors import OperationFailure

from hascheduler.core.claims import Claim
from hascheduler.core.entries import Entry, Written
from hascheduler.core.fire_queue import Due, FireQueue
from hascheduler.storage.lease import LeaseTimings

log = structlog.get_logger("hascheduler.dispatch")

T = TypeVar("T")

BEGINNING = dt.datetime.min.replace(tzinfo=dt.UTC)
# A ledger read of a term lasts at most this many lease ttls, however long the term holds.
READ_LIMIT_TTLS = 3.0


class HeldLease(Protocol):
    """What a term asks of the lease before each claim and publish."""

    @property
    def valid(self) -> bool: ...

    @property
    def term(self) -> int | None: ...

    @property
    def timings(self) -> LeaseTimings: ...

    def remaining(self) -> float: ...


class TermService(Protocol):
    """A piece of leader work: started when a term begins, in the term's task group, and
    stopped with it; it asks the term (``check``, ``holds``) whether it may act."""

    async def run(self, term: Term) -> None: ...


class LeadershipLost(Exception):
    """The term no longer holds the lease (its renew deadline passed, or a newer term
    began): stop claiming at once."""


class _Writes:
    """The ledger writes of a replica's terms in flight, and when one last ended without
    the server's answer (a timeout, a lost connection: it may be applied yet, so no lease
    is released soon after; monotonic seconds)."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()
        self.unanswered_at: float | None = None

    def ended(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        # The server answered, if only to refuse: the write's fate is known.
        answered = not task.cancelled() and (
            task.exception() is None or isinstance(task.exception(), OperationFailure)
        )
        if not answered:
            self.unanswered_at = time.monotonic()


class Term:
    def __init__(
        self,
        number: int,
        lease: HeldLease,
        entries: Mapping[str, Entry],
        started_at: dt.datetime = BEGINNING,
    ) -> None:
        self.number = number
        # When the term began: what fell due before it is its catch-up's.
        self.started_at = started_at
        self._lease = lease
        self.watermark: dt.datetime | None = None
        # While the term catches up on what fell due before it (``catching_up``), the
        # watermark it took over (``taken_over``) is recorded in its place, so a next
        # leader catches up from there; in a database's first term there is none, and
        # none is recorded, so a next leader catches each schedule up from its creation
        # again.
        self.catching_up = False
        self.taken_over: dt.datetime | None = None
        # Fires due up to this instant may be in the ledger already (claimed ahead by the
        # term before, or fired by it before its successor's catch-up looks at them): their
        # claims read the ledger first (Ledger.claimed).
        self.contested_until = BEGINNING
        self.queue = FireQueue(entries)
        # The claims of this term not yet published (or given up), by fire id, with their
        # due times; and those due times counted, for when the next publish is due.
        self.pending: dict[str, dt.datetime] = {}
        self._due: Counter[dt.datetime] = Counter()
        # Instants taken off the queue (or planned late) and not yet claimed or recorded
        # skipped, by (schedule id, nominal time): the lease's watermark stays before them.
        self.open: dict[tuple[str, dt.datetime], Due] = {}
        self.deferred: set[str] = set()  # fan-out fires waiting for their source, by id
        # Changes the mirror applied before the term had a watermark (while it started),
        # with when each was made: their seed plans them from the term's start (or from
        # a creation after it), and what fell due before it is claimed apart
        # (Dispatcher.lead, late_fires).
        self.early_changes: dict[str, Written] = {}
        self.active = False
        self.handing_over = asyncio.Event()
        self._publishing: set[asyncio.Task[None]] = set()
        self._waiting: set[asyncio.Task[None]] = set()
        self._writes = _Writes()
        self._ended_through: dt.datetime | None = None  # fired_through when the term ended

    def take_over(self, since: dt.datetime | None) -> None:
        """The term catches up from ``since``, the watermark it took over (None: a
        database's first term), which the lease records until ``caught_up``."""
        self.catching_up, self.taken_over = True, since

    def caught_up(self) -> None:
        """What fell due before the term is claimed or recorded skipped."""
        self.catching_up = False

    def advance(self, now: dt.datetime) -> None:
        """Every fire due by ``now`` is taken off the queue (its instant held open until
        claimed or recorded skipped): the watermark moves to ``now``."""
        self.watermark = now

    def contest_until(self, at: dt.datetime) -> None:
        """Fires due up to ``at`` may be in the ledger already: their claims read it
        first."""
        self.contested_until = at

    def note_early_change(self, schedule_id: str, written: Written) -> None:
        """A change applied before the term had a watermark; its first one counts."""
        self.early_changes.setdefault(schedule_id, written)

    def take_early_changes(self) -> dict[str, Written]:
        """The changes applied while the term started, handed over once."""
        changes, self.early_changes = self.early_changes, {}
        return changes

    async def __aenter__(self) -> Term:
        self.active = True
        return self

    async def __aexit__(self, *_: object) -> None:
        # Fixed as the term ends: what it had not claimed stays ahead of the watermark.
        self._ended_through = self.fired_through
        self.active = False
        self.queue.clear()
        for task in self._waiting:
            task.cancel()

    @property
    def holds(self) -> bool:
        """The fence: the lease is still this term's and its renew deadline has not
        passed, and this lead of it has not ended (but for its handover's drain). A
        replica that stops firing and leads again in the same term (a renewal late past
        its deadline, then made) leads it anew: the tasks of the lead before must not act
        beside it, or the two decide on one fire apart (one publishes a fire the other
        recorded skipped)."""
        return (
            (self.active or self.handing_over.is_set())
            and self._lease.valid
            and self._lease.term == self.number
        )

    def check(self) -> None:
        """Raises LeadershipLost unless the term still holds the lease."""
        if not self.holds:
            raise LeadershipLost

    def remaining(self) -> float:
        """Seconds the term may still act without another renewal."""
        return self._lease.remaining()

    async def write(self, work: Coroutine[Any, Any, T]) -> T:
        """A ledger write of this term (``work``), bounded by what remains of the term:
        the driver sends the rest as maxTimeMS, so a write the server holds up past the
        renew deadline is refused rather than applied for a deposed leader. It is carried
        on to its answer if the caller is cancelled: abandoned in flight, it could be
        applied after the handover released the lease, when the next term may act
        (``settle`` waits for it). Raises LeadershipLost when the term's time runs out."""
        remaining = max(self.remaining(), 0.001)
        with pymongo.timeout(remaining):  # the task copies the deadline with the context
            task = asyncio.create_task(work)
        self._writes.tasks.add(task)
        task.add_done_callback(self._writes.ended)
        try:
            return await asyncio.wait_for(asyncio.shield(task), remaining)
        except TimeoutError:
            raise LeadershipLost from None

    async def write_or_defer(self, work: Coroutine[Any, Any, T]) -> T | None:
        """A write the caller makes again at its next turn: idempotent, and no state of the
        term waits on its outcome (a periodic adoption of older terms' claims). Bounded as
        ``write``; when it outlasts what remains of the term while the term still holds
        the lease (waiting for a connection in a pool the database holds up, say), it
        returns None rather than stop the lead (``settle`` still waits for it). Raises
        LeadershipLost once the term no longer holds."""
        try:
            return await self.write(work)
        except LeadershipLost:
            if not self.holds:
                raise
            log.info("write_deferred", term=self.number)
            return None

    async def read(self, work: Coroutine[Any, Any, T]) -> T:
        """A ledger read that decides a write of this term (which fires are claimed
        already, which left claims to adopt). It changes nothing, and the write it decides
        is fenced on its own (by the term in its filter, and by what remains of the term
        when it starts), so a read may last as long as the term holds the lease, renewals
        included: a pool the database holds up delays the fire loop, but stops it only
        when the lease is lost (with a fixed budget, it stopped and led again in the same
        term). Raises LeadershipLost once the term no longer holds, or when the read
        outlasts READ_LIMIT_TTLS lease ttls (a connection that went silent: the driver
        sets no socket timeout of its own)."""
        loop = asyncio.get_running_loop()
        limit_s = READ_LIMIT_TTLS * self._lease.timings.ttl
        looking: asyncio.TimerHandle | None = None

        def look() -> None:
            # At the moment the term's time would run out: renewed meanwhile, the read
            # goes on until the new end; otherwise it is abandoned now.
            nonlocal looking
            left = self.remaining() if self.holds else 0.0
            if left > 0:
                looking = loop.call_later(left, look)
            else:
                bound.reschedule(loop.time())

        try:
            # In the calling task: a task of its own (wait_for's, on Python 3.11) would wait
            # its turn behind the loop's other work at a busy second.
            with pymongo.timeout(limit_s):
                async with asyncio.timeout(limit_s) as bound:
                    looking = loop.call_later(max(self.remaining(), 0.001), look)
                    try:
                        return await work
                    finally:
                        if looking is not None:
                            looking.cancel()
        except TimeoutError:
            raise LeadershipLost from None

    def follows(self, earlier: Term) -> None:
        """This replica's lead before this one was ``earlier`` (the same term, led again
        after a write timed out, say): its writes still in flight are this one's too."""
        self._writes = earlier._writes

    async def settle(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) for the writes of this term in flight; True when
        every one had its answer, and none went unanswered within the lease's ttl: then
        releasing the lease cannot let a write of this term land after it."""
        writes = self._writes
        if writes.tasks:
            await asyncio.wait(list(writes.tasks), timeout=max(timeout_s, 0.001))
        recent = (
            writes.unanswered_at is not None
            and time.monotonic() - writes.unanswered_at < self._lease.timings.ttl
        )
        return not writes.tasks and not recent

    @property
    def fired_through(self) -> dt.datetime | None:
        """What the lease records as handled: the watermark, held back to the one taken
        over while the catch-up runs (none, in a database's first term), before every
        instant taken and not yet claimed or recorded skipped (``open``: a fan-out fire
        waiting for its source, a batch whose claim is in flight, a late change's fires)
        and before every fire still queued, so a next leader's catch-up covers them. Once
        the term has ended, what it was then."""
        if not self.active and self._ended_through is not None:
            return self._ended_through
        if self.watermark is None:
            return None
        held = [self.watermark]
        if self.catching_up:
            if self.taken_over is None:
                return None
            held.append(self.taken_over)
        if self.open:
            earliest = min(d.fire_at for d in self.open.values())
            held.append(earliest - dt.timedelta(microseconds=1))
        # A change applied late queues fires due before the watermark (Dispatcher.
        # on_change); until they are claimed, a next leader's catch-up must cover them.
        first = self.queue.first_at()
        if first is not None:
            held.append(first - dt.timedelta(microseconds=1))
        return min(held)

    def take(self, horizon: dt.datetime, limit: int) -> list[Due]:
        """Up to ``limit`` queued fires due by ``horizon``, taken open."""
        batch = self.queue.take_due(horizon, limit)
        self.opened(batch)
        return batch

    def opened(self, dues: Iterable[Due]) -> None:
        """These instants (planned apart from the queue: a late change's) are taken."""
        for due in dues:
            self.open[(due.schedule_id, due.nominal)] = due

    def resolved(self, dues: Iterable[Due]) -> None:
        """These instants are claimed or recorded skipped: the watermark may pass them."""
        for due in dues:
            self.open.pop((due.schedule_id, due.nominal), None)

    def put_back(self, due: Due, at: dt.datetime) -> None:
        """Take ``due`` again from the queue at ``at`` (a quota's later slot, a claim to
        try again): the queue holds the watermark before it meanwhile."""
        self.queue.defer(due, at)
        self.resolved([due])

    def add_pending(self, claims: Iterable[Claim]) -> None:
        """These claims of this term await their publish."""
        for claim in claims:
            if claim.fire_id not in self.pending:
                self.pending[claim.fire_id] = claim.due_at
                self._due[claim.due_at] += 1

    def remove_pending(self, claims: Iterable[Claim]) -> None:
        """These claims are published, or will not be by this term."""
        for claim in claims:
            due = self.pending.pop(claim.fire_id, None)
            if due is not None:
                self._due[due] -= 1
                if self._due[due] <= 0:
                    del self._due[due]

    def next_publish_at(self) -> dt.datetime | None:
        """When the earliest claim awaiting its publish is due, if any."""
        return min(self._due) if self._due else None

    def start_publishing(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``work`` (publishing claims of this term) until done or drained."""
        task = asyncio.create_task(work)
        self._publishing.add(task)
        task.add_done_callback(self._published)
        return task

    def _published(self, task: asyncio.Task[None]) -> None:
        self._publishing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("publish_batch_failed", term=self.number, error=repr(task.exception()))

    def start_waiting(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` (a wait for a fan-out source) until done or the term ends."""
        task = asyncio.create_task(work)
        self._waiting.add(task)
        task.add_done_callback(self._waiting.discard)

    async def drain(self, timeout_s: float) -> None:
        """Let publishes in flight finish (at most ``timeout_s``); claims not yet due are
        left to the next leader."""
        self.handing_over.set()
        if self._publishing:
            await asyncio.wait(list(self._publishing), timeout=timeout_s)
