"""The change log: every write as an ordered event, in a bounded ring (the "oplog").

Resume tokens are opaque to clients but ordered: ``_data`` is a fixed-width hex string of
(cluster time seconds, increment, sequence number, flags), so comparing two tokens as
strings orders them like their events. A token means "after this event"; resuming from a
point whose following events fell off the ring answers 286 ChangeStreamHistoryLost.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from bson import Timestamp

from hascheduler_dev.devmongo.errors import MongoError
from hascheduler_dev.devmongo.values import Document, key_of

TOKEN_FLAG_INVALIDATE = 0x01
NO_KEY: Any = object()  # a ChangeEvent's key_id when it is about no document
_EPOCH = datetime.datetime(1970, 1, 1)  # naive UTC, as the server keeps dates


class ClusterClock:
    """The server's logical clock: a Timestamp that strictly increases with every tick.

    Kept as two integers: every write ticks it, and a bson Timestamp built (and read
    through its properties) per write cost more than the rest of recording the write's
    change event."""

    def __init__(self) -> None:
        self._secs, self._inc = int(time.time()), 0
        self._current: Timestamp | None = None

    @property
    def current(self) -> Timestamp:
        if self._current is None:
            self._current = Timestamp(self._secs, self._inc)
        return self._current

    def advance(self, now_s: float) -> tuple[int, int]:
        """The next tick at wall time ``now_s``, as (seconds, increment)."""
        now = int(now_s)
        if now > self._secs:
            self._secs, self._inc = now, 1
        else:
            self._inc += 1
        self._current = None
        return self._secs, self._inc

    def tick(self) -> Timestamp:
        return Timestamp(*self.advance(time.time()))


def encode_token(ts: Timestamp | tuple[int, int], seq: int, flags: int = 0) -> Document:
    secs, inc = (ts.time, ts.inc) if isinstance(ts, Timestamp) else ts
    return {"_data": f"82{secs:08X}{inc:08X}{seq:016X}{flags:02X}"}


def decode_token(token: Any) -> tuple[int, int]:
    """The (sequence number, flags) a resume token stands for.

    Raises MongoError 260 InvalidResumeToken for anything we did not issue.
    """
    data = token.get("_data") if isinstance(token, dict) else None
    if not isinstance(data, str) or len(data) != 36 or not data.startswith("82"):
        raise MongoError(260, f"invalid resume token: {token!r}")
    try:
        return int(data[18:34], 16), int(data[34:36], 16)
    except ValueError as exc:
        raise MongoError(260, f"invalid resume token: {token!r}") from exc


@dataclass(slots=True)
class ChangeEvent:
    seq: int
    ticked: tuple[int, int]  # the cluster time (seconds, increment): see ClusterClock
    wall_time: datetime.datetime
    db: str
    coll: str | None
    operation_type: str
    # The written document's _id (NO_KEY: the event is about no document, as a drop):
    # its documentKey is built only when a stream shows the event.
    key_id: Any = NO_KEY
    full_document: Document | None = None
    update_description: Document | None = None
    # For updates: the document before, so the description is computed only when a stream
    # shows the event (most updates are never watched).
    before: Document | None = None

    @property
    def document_key(self) -> Document | None:
        return None if self.key_id is NO_KEY else {"_id": self.key_id}

    @property
    def cluster_time(self) -> Timestamp:
        return Timestamp(*self.ticked)

    @property
    def token(self) -> Document:
        return encode_token(self.ticked, self.seq)

    def to_document(self) -> Document:
        doc: Document = {
            "_id": self.token,
            "operationType": self.operation_type,
            "clusterTime": self.cluster_time,
            "wallTime": self.wall_time,
        }
        ns: Document = {"db": self.db}
        if self.coll is not None:
            ns["coll"] = self.coll
        doc["ns"] = ns
        if self.document_key is not None:
            doc["documentKey"] = self.document_key
        if (
            self.update_description is None
            and self.before is not None
            and self.full_document is not None
        ):
            self.update_description = describe_update(self.before, self.full_document)
            self.before = None
        if self.update_description is not None:
            doc["updateDescription"] = self.update_description
        return doc


class ChangeLog:
    """Bounded, ordered log of change events with async waiting for new ones."""

    def __init__(self, clock: ClusterClock, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("the change log needs room for at least one event")
        self.clock = clock
        self.capacity = capacity
        self._events: deque[ChangeEvent] = deque(maxlen=capacity)
        self._last_seq = 0
        # History before the server started, or that fell off the ring, is lost: resuming
        # at or before this cluster time answers 286, as a real oplog's start does.
        self._history_starts_after = clock.advance(time.time())
        # Set by the next append; created only when someone waits (most appends have no
        # waiter, and an Event per write showed in write profiles).
        self._appended: asyncio.Event | None = None
        self._wall_ms = 0
        self._wall = _EPOCH
        # The last event's sequence number in each (database, collection) and each
        # database: a stream on one collection skips, without looking at them, the many
        # events of the others (a fires ledger's writes past a schedules mirror's stream).
        self.last_in: dict[tuple[str, str | None], int] = {}
        self.last_in_db: dict[str, int] = {}

    @property
    def last_seq(self) -> int:
        return self._last_seq

    @property
    def last_ticked(self) -> tuple[int, int] | None:
        """The last event's cluster time (seconds, increment), if any is kept."""
        return self._events[-1].ticked if self._events else None

    @property
    def first_seq(self) -> int:
        return self._events[0].seq if self._events else self._last_seq + 1

    def append(
        self,
        db: str,
        coll: str | None,
        operation_type: str,
        key_id: Any = NO_KEY,
        full_document: Document | None = None,
        before: Document | None = None,
    ) -> ChangeEvent:
        if len(self._events) == self.capacity:
            self._history_starts_after = self._events[0].ticked
        self._last_seq = seq = self._last_seq + 1
        now_s = time.time()
        ticked = self.clock.advance(now_s)
        # Millisecond precision, as BSON dates have; one datetime per millisecond is shared
        # by the events written in it (a batch of 1,000 writes is a handful of them).
        now_ms = int(now_s * 1000)
        if now_ms != self._wall_ms:
            self._wall_ms = now_ms
            self._wall = _EPOCH + datetime.timedelta(milliseconds=now_ms)
        event = ChangeEvent(
            seq, ticked, self._wall, db, coll, operation_type, key_id, full_document, None, before
        )
        self._events.append(event)
        self.last_in[db, coll] = self.last_in_db[db] = seq
        if self._appended is not None:  # wake every waiter once; later ones get a new event
            self._appended.set()
            self._appended = None
        return event

    def check_resumable_after(self, seq: int) -> None:
        """Raises 286 when an event after ``seq`` is no longer in the ring."""
        if seq > self._last_seq:
            raise MongoError(260, "resume token is from the future of this server")
        if seq + 1 < self.first_seq:
            raise MongoError(
                286,
                "Resume of change stream was not possible, as the resume "
                "point may no longer be in the oplog.",
                errorLabels=["NonResumableChangeStreamError"],
            )

    def seq_at_time(self, ts: Timestamp) -> int:
        """Position just before the first event at or after ``ts``.

        Raises 286 when events at or after ``ts`` fell off the ring.
        """
        wanted = (ts.time, ts.inc)
        if wanted <= self._history_starts_after:
            raise MongoError(
                286,
                "Resume of change stream was not possible, as the resume "
                "point may no longer be in the oplog.",
                errorLabels=["NonResumableChangeStreamError"],
            )
        events = self._events
        lo, hi = 0, len(events)
        while lo < hi:
            mid = (lo + hi) // 2
            if events[mid].ticked < wanted:
                lo = mid + 1
            else:
                hi = mid
        return events[lo].seq - 1 if lo < len(events) else self._last_seq

    def after(self, seq: int) -> Iterator[ChangeEvent]:
        """Events with a sequence number greater than ``seq``, oldest first."""
        self.check_resumable_after(seq)
        start = seq + 1 - self.first_seq
        for i in range(max(start, 0), len(self._events)):
            yield self._events[i]

    async def wait_after(self, seq: int, wait_s: float) -> bool:
        """Wait up to ``wait_s`` seconds until an event after ``seq`` exists; False if none."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while self._last_seq <= seq:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return False
            if self._appended is None:
                self._appended = asyncio.Event()
            try:
                await asyncio.wait_for(self._appended.wait(), remaining)
            except TimeoutError:
                return False
        return True


def describe_update(old: Document, new: Document) -> Document:
    """MongoDB's updateDescription: dotted paths for changes inside embedded documents."""
    updated: Document = {}
    removed: list[str] = []

    def walk(a: Document, b: Document, prefix: str) -> None:
        for k, v in b.items():
            path = prefix + k
            if k not in a:
                updated[path] = v
            elif isinstance(v, dict) and isinstance(a[k], dict) and v and a[k]:
                walk(a[k], v, path + ".")
            elif key_of(a[k]) != key_of(v) or type(a[k]) is not type(v):
                updated[path] = v
        removed.extend(prefix + k for k in a if k not in b)

    walk(old, new, "")
    return {"updatedFields": updated, "removedFields": removed, "truncatedArrays": []}
