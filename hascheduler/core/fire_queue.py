"""The leader's queue of fires waiting for their due time (pure: no I/O, no clock).

A heap of ``Due`` items, one per schedule: when one is taken, that schedule's following
fire is queued. An item whose schedule was since deleted, paused or changed (a newer
revision queues its own item) is dropped when it comes up. The heap is built once per term
by ``seed`` (a generator: the caller yields to its event loop between its steps), and kept
current by ``changed`` from the mirror's change callback.
"""

from __future__ import annotations

import datetime as dt
import heapq
from collections.abc import Iterator, Mapping
from typing import NamedTuple

from hascheduler.core.entries import Entry, Written
from hascheduler.core.triggers import fire_times, jitter_offset, made_since

# Entries walked between two steps of ``seed``: computing every schedule's next fire takes
# seconds at 100k schedules, and the lease must keep renewing meanwhile (a blocked loop
# misses the renew deadline and leadership thrashes).
SEED_STEP = 1000


class Due(NamedTuple):
    """A fire waiting in the heap. A tuple: the heap compares them in C (a dataclass's
    generated ``__lt__`` was a twentieth of the leader's CPU at 10k fires/s)."""

    fire_at: dt.datetime
    nominal: dt.datetime
    schedule_id: str
    revision: int


def is_fire_time(entry: Entry, nominal: dt.datetime) -> bool:
    """Whether ``nominal`` is one of the trigger's fire times."""
    first = next(
        iter(fire_times(entry.trigger, nominal - dt.timedelta(milliseconds=1), limit=1)), None
    )
    return first is not None and abs((first - nominal).total_seconds()) < 0.0005


def next_due(schedule_id: str, entry: Entry, after: dt.datetime) -> Due | None:
    """The first fire of ``entry`` whose jittered time is after ``after`` (and, paused
    until an instant, whose nominal time is not before it)."""
    if entry.paused_until is not None and entry.paused:
        after = max(after, entry.paused_until - dt.timedelta(microseconds=1))
    start = after - dt.timedelta(seconds=entry.jitter)
    for nominal in fire_times(entry.trigger, start, limit=10_000):
        fire_at = nominal + jitter_offset(schedule_id, nominal, entry.jitter)
        if made_since(fire_at, after):
            return Due(fire_at, nominal, schedule_id, entry.revision)
    return None


class FireQueue:
    """Due fires of the schedules in ``entries`` (the mirror's), earliest first."""

    def __init__(self, entries: Mapping[str, Entry]) -> None:
        self.entries = entries
        self._heap: list[Due] = []
        # Fires taken once and put back for later (a namespace's quota slot): their
        # schedules' next fires are queued already.
        self._deferred: list[Due] = []
        self._seeding = False
        # Schedules changed while the heap was being built: queued again after.
        self._changed_while_seeding: set[str] = set()

    def __len__(self) -> int:
        return len(self._heap) + len(self._deferred)

    def items(self) -> list[Due]:
        return [*self._heap, *self._deferred]

    def seed(
        self,
        now: dt.datetime,
        early_changes: Mapping[str, Written],
        created_since: Mapping[str, dt.datetime],
    ) -> Iterator[None]:
        """Rebuild the heap with every unpaused schedule's first fire after ``now``, or
        after its creation for one created since: one whose creation the caller saw
        (``early_changes``, which it keeps adding to while it seeds) or read
        (``created_since``: a creation stamped after ``now`` by a replica whose clock
        bound ran ahead of the caller's). Yields every SEED_STEP schedules so that the
        caller can let its loop run."""
        self._seeding = True
        self._changed_while_seeding.clear()
        heap: list[Due] = []

        def first(schedule_id: str, entry: Entry) -> Due | None:
            written = early_changes.get(schedule_id)
            created = written.created_at if written is not None else None
            created = created or created_since.get(schedule_id)
            # Nothing of a schedule falls due before its creation (made_since).
            return next_due(schedule_id, entry, max(now, created) if created else now)

        try:
            for i, (schedule_id, entry) in enumerate(list(self.entries.items())):
                if i % SEED_STEP == SEED_STEP - 1:
                    yield
                if not entry.dormant:
                    due = first(schedule_id, entry)
                    if due is not None:
                        heap.append(due)
            # A schedule changed after it was visited would otherwise keep its stale item,
            # which take_due drops at its time: queue its current state too.
            for schedule_id in self._changed_while_seeding:
                changed = self.entries.get(schedule_id)
                if changed is not None and not changed.dormant:
                    due = first(schedule_id, changed)
                    if due is not None:
                        heap.append(due)
            heapq.heapify(heap)
            self._heap = heap
        finally:
            self._seeding = False
            self._changed_while_seeding.clear()

    def changed(self, schedule_id: str, entry: Entry | None, watermark: dt.datetime | None) -> bool:
        """A schedule changed (``entry`` None: deleted): queue its next fire after
        ``watermark`` (None: no heap yet, the next seed reads it). True when something was
        queued."""
        if self._seeding:
            self._changed_while_seeding.add(schedule_id)
            return False
        if entry is None or entry.dormant or watermark is None:
            return False  # a queued item of it is dropped when it comes up
        due = next_due(schedule_id, entry, watermark)
        if due is None:
            return False
        heapq.heappush(self._heap, due)
        return True

    def first_at(self) -> dt.datetime | None:
        heads = [q[0].fire_at for q in (self._heap, self._deferred) if q]
        return min(heads) if heads else None

    def defer(self, due: Due, until: dt.datetime) -> None:
        """Take ``due`` (taken once already) again at ``until``."""
        heapq.heappush(self._deferred, due._replace(fire_at=until))

    def take_due(self, horizon: dt.datetime, limit: int) -> list[Due]:
        """Up to ``limit`` current fires due by ``horizon``, each schedule's next queued."""
        batch: list[Due] = []
        while len(batch) < limit:
            if (
                self._deferred
                and self._deferred[0].fire_at <= horizon
                and (not self._heap or self._deferred[0] <= self._heap[0])
            ):
                due = heapq.heappop(self._deferred)
                if self._current(due) is not None:
                    batch.append(due)
                continue
            if not self._heap or self._heap[0].fire_at > horizon:
                break
            due = heapq.heappop(self._heap)
            entry = self._current(due)
            if entry is None:
                continue
            batch.append(due)
            following = next_due(due.schedule_id, entry, due.fire_at)
            if following is not None:
                heapq.heappush(self._heap, following)
        return batch

    def clear(self) -> None:
        self._heap = []
        self._deferred = []

    def _current(self, due: Due) -> Entry | None:
        entry = self.entries.get(due.schedule_id)
        if entry is None or entry.revision != due.revision or entry.paused_at(due.nominal):
            return None  # deleted, changed (a newer item is queued) or paused
        return entry
