"""Every replica's in-memory copy of the schedules, kept current by a change stream.

Order of operations (invariant 2, docs/ARCHITECTURE.md): open the change stream first and
keep its start point, then load every schedule, then apply the stream's events in order. An
event whose revision is not newer than the mirror's copy is ignored, so the replay of
changes that the load already saw never moves a schedule backwards. A resumable error
reopens the stream from the last token; history lost (286) or an invalidate triggers a full
resync, which leaves unchanged entries alone. While not in sync the mirror is not ready.

Entries are compact (no payload, name or labels): a trigger and the few fields firing needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from typing import Any, Literal, Protocol

import structlog
from bson import Timestamp
from pymongo.errors import OperationFailure, PyMongoError

from hascheduler.core import triggers
from hascheduler.core.constants import (
    STREAM_MAX_AWAIT_MS,
    STREAM_RETRY_INITIAL_S,
    STREAM_RETRY_MAX_S,
)
from hascheduler.core.entries import Entry, Written, entry_from_document
from hascheduler.core.instants import as_utc
from hascheduler.storage.streams import open_change_stream, read_all

log = structlog.get_logger("hascheduler.mirror")

HISTORY_LOST = 286
RECENTLY_APPLIED = 1024
INVALID_RESUME_TOKEN = 260
# A load reads the collection in batches of LOAD_BATCH and builds from chunks of LOAD_CHUNK,
# at most LOAD_AHEAD chunks read ahead of the building: a whole batch fits, so the next
# batch is asked for as soon as one arrives.
LOAD_BATCH, LOAD_CHUNK, LOAD_AHEAD = 10_000, 1_000, 16


Action = (
    tuple[Literal["upsert"], str, dict[str, Any]]
    | tuple[Literal["remove"], str, None]
    | tuple[Literal["ignore"], str, str]
)


def decide(event: dict[str, Any], current_revision: int | None) -> Action:
    """What one change event does to the mirror: pure, given the mirror's revision."""
    op = event.get("operationType")
    key = event.get("documentKey", {}).get("_id")
    if op == "delete":
        return ("remove", key, None)
    if op in {"insert", "replace", "update"}:
        doc = event.get("fullDocument")
        if doc is None:
            return ("ignore", key, "document gone before lookup; its delete follows")
        if current_revision is not None and int(doc["revision"]) <= current_revision:
            return ("ignore", key, "stale revision")
        return ("upsert", key, doc)
    return ("ignore", str(key), f"operation {op}")


class WatchedCollection(Protocol):
    """The slice of a driver collection the mirror uses (PyMongo async or Motor)."""

    def watch(self, *args: Any, **kwargs: Any) -> Any: ...
    def find(self, *args: Any, **kwargs: Any) -> Any: ...


class StreamInvalidated(Exception):
    """The change stream ended with an invalidate event (collection dropped or renamed)."""


class ChangeMirror:
    """What every mirror of a collection shares: the change-stream loop that keeps it in
    sync (open first, load, follow; resume on errors; resync on lost history), readiness
    and status. Subclasses say what they keep of each document (``apply``, ``_load_all``,
    ``size``, ``digest``)."""

    # Ready as soon as the load is done (the schedules' revisions make a replayed event
    # harmless). A mirror that cannot tell a replayed event from a new one waits until the
    # stream has caught up past the load instead.
    READY_AFTER_LOAD = True
    NAME = "mirror"  # in log events: mirror_ready, <NAME>_resynced, ...

    def __init__(self, collection: WatchedCollection) -> None:
        self._coll = collection
        self.ready = False
        self.last_applied: Timestamp | None = None
        self.resyncs = 0
        self.resumes = 0
        self._token: Any = None
        self._ready_event = asyncio.Event()
        self._stopping = False

    # -- what a subclass keeps ------------------------------------------------------------

    @property
    def size(self) -> int:
        raise NotImplementedError

    @property
    def digest(self) -> str:
        raise NotImplementedError

    def apply(self, event: dict[str, Any]) -> str:
        """Apply one change event; returns what it did (upsert, remove or ignore)."""
        raise NotImplementedError

    async def _load_all(self) -> tuple[int, int]:
        """Replace the content with the collection's; (changed, removed)."""
        raise NotImplementedError

    def _applied(self, event: dict[str, Any]) -> None:
        if isinstance(event.get("clusterTime"), Timestamp):
            self.last_applied = event["clusterTime"]

    # -- state ----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        last = self.last_applied
        return {
            "ready": self.ready,
            "size": self.size,
            "digest": self.digest,
            "last_applied_cluster_time": None
            if last is None
            else {
                "t": last.time,
                "i": last.inc,
                "at": dt.datetime.fromtimestamp(last.time, dt.UTC).isoformat(),
            },
            "resyncs": self.resyncs,
            "resumes": self.resumes,
        }

    async def wait_ready(self) -> None:
        await self._ready_event.wait()

    def _set_ready(self, ready: bool) -> None:
        if ready != self.ready:
            log.info(f"{self.NAME}_ready" if ready else f"{self.NAME}_not_ready", size=self.size)
        self.ready = ready
        if ready:
            self._ready_event.set()
        else:
            self._ready_event.clear()

    # -- syncing --------------------------------------------------------------------------

    async def _open(self, **options: Any) -> Any:
        return await open_change_stream(
            self._coll,
            full_document="updateLookup",
            max_await_time_ms=STREAM_MAX_AWAIT_MS,
            **options,
        )

    def stop(self) -> None:
        """Ask ``run`` to return (within one stream wait); cancellation alone is not
        enough while a driver call is selecting a server that has gone away."""
        self._stopping = True

    async def run(self) -> None:
        """Sync until stopped: resume on errors, resync when history is lost.

        Written out rather than a retry library's loop: what a failure does depends on
        which it was (lost history drops the resume token, an invalidate resyncs at once
        and resets the backoff), which a retry policy keyed on attempt counts cannot say.
        """
        delay = STREAM_RETRY_INITIAL_S
        while not self._stopping:
            try:
                if self._token is None:
                    await self._resync_and_follow()
                else:
                    await self._resume_and_follow()
            except asyncio.CancelledError:
                self._set_ready(False)
                raise
            except StreamInvalidated:
                log.info(f"{self.NAME}_stream_invalidated")
                self._token = None
                delay = STREAM_RETRY_INITIAL_S
                continue
            except OperationFailure as exc:
                if exc.code in {HISTORY_LOST, INVALID_RESUME_TOKEN} or exc.has_error_label(
                    "NonResumableChangeStreamError"
                ):
                    log.warning(f"{self.NAME}_history_lost", code=exc.code, error=str(exc))
                    self._token = None
                else:
                    log.warning(f"{self.NAME}_stream_failed", code=exc.code, error=str(exc))
            except PyMongoError as exc:
                log.warning(f"{self.NAME}_stream_failed", error=str(exc))
            self._set_ready(False)
            await asyncio.sleep(delay)
            delay = min(delay * 2, STREAM_RETRY_MAX_S)

    async def _resync_and_follow(self) -> None:
        self._set_ready(False)
        stream = await self._open()
        async with stream:
            # The stream is open, so nothing written from here on can be missed: keep its
            # start point, then load.
            self._token = stream.resume_token
            changed, removed = await self._load_all()
            self.resyncs += 1
            log.info(f"{self.NAME}_resynced", size=self.size, changed=changed, removed=removed)
            if self.READY_AFTER_LOAD:
                self._set_ready(True)
            await self._follow(stream)

    async def _resume_and_follow(self) -> None:
        stream = await self._open(resume_after=self._token)
        async with stream:
            self.resumes += 1
            log.info(f"{self.NAME}_stream_resumed")
            if self.READY_AFTER_LOAD:
                self._set_ready(True)
            await self._follow(stream)

    async def _follow(self, stream: Any) -> None:
        while not self._stopping:
            event = await stream.try_next()
            if event is not None:
                if event.get("operationType") == "invalidate":
                    raise StreamInvalidated
                self.apply(event)
            elif not stream.alive:
                raise PyMongoError("the change stream closed")
            elif not self.ready:  # caught up with the stream: past the load
                self._set_ready(True)
            token = stream.resume_token
            if token is not None:
                self._token = token


def _date(value: Any) -> dt.datetime | None:
    """A stored or streamed instant, in UTC; None for anything but a date."""
    return as_utc(value) if isinstance(value, dt.datetime) else None


async def read_ahead(
    cursor: AsyncIterable[dict[str, Any]], chunk: int = LOAD_CHUNK, ahead: int = LOAD_AHEAD
) -> AsyncIterator[list[dict[str, Any]]]:
    """The cursor's documents in chunks, read by a task of their own: while the caller
    builds from one batch, the next is on its way (with a plain ``async for`` the server
    waits while the caller builds, and the caller while the server encodes)."""
    chunks: asyncio.Queue[list[dict[str, Any]] | BaseException | None] = asyncio.Queue(ahead)

    async def read() -> None:
        try:
            docs: list[dict[str, Any]] = []
            async for doc in cursor:
                docs.append(doc)
                if len(docs) == chunk:
                    await chunks.put(docs)
                    docs = []
            await chunks.put(docs)
            await chunks.put(None)
        except Exception as exc:  # handed to the caller, raised there
            await chunks.put(exc)

    reader = asyncio.create_task(read())
    try:
        while (docs := await chunks.get()) is not None:
            if isinstance(docs, BaseException):
                raise docs
            yield docs
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


# Called for every change the mirror applies: the schedule's id, its entry (None: gone),
# and when the change was made (None for the first load's documents).
OnChange = Callable[[str, Entry | None, Written | None], None]


class Mirror(ChangeMirror):
    """The mirror of the schedules; ``run()`` keeps it in sync until cancelled."""

    def __init__(self, collection: WatchedCollection, on_change: OnChange | None = None) -> None:
        super().__init__(collection)
        self.on_change = on_change
        self.entries: dict[str, Entry] = {}
        self.invalid: dict[str, str] = {}  # id -> why its stored document was refused
        self._digest: str | None = None
        # When the latest changes were applied (wall clock), for measuring propagation;
        # bounded so it never grows with the number of schedules.
        self.recently_applied: OrderedDict[str, float] = OrderedDict()

    @property
    def size(self) -> int:
        return len(self.entries)

    @property
    def digest(self) -> str:
        """sha256 over the sorted (id, revision) pairs: equal digests, equal mirrors."""
        if self._digest is None:
            h = hashlib.sha256()
            for schedule_id in sorted(self.entries):
                h.update(f"{schedule_id}\0{self.entries[schedule_id].revision}\n".encode())
            self._digest = h.hexdigest()
        return self._digest

    def status(self) -> dict[str, Any]:
        return {**super().status(), "invalid": len(self.invalid)}

    def _put(
        self,
        schedule_id: str,
        doc: dict[str, Any],
        streamed: bool = True,
        written: Written | None = None,
    ) -> None:
        """Keep ``doc``'s entry; a ``streamed`` change's time is noted in
        ``recently_applied`` (a load's are not: they propagate nothing, and noting a
        million of them churned the record through a whole load)."""
        try:
            entry = entry_from_document(doc)
        except (triggers.InvalidTrigger, KeyError, TypeError, ValueError) as exc:
            # A document written around the API: keep the replica alive, say so.
            log.warning("schedule_document_refused", schedule_id=schedule_id, error=str(exc))
            self._remove(schedule_id, written)
            self.invalid[schedule_id] = str(exc)
            return
        self.invalid.pop(schedule_id, None)
        self.entries[schedule_id] = entry
        self._digest = None
        if streamed:
            self.recently_applied[schedule_id] = time.time()
            self.recently_applied.move_to_end(schedule_id)
            if len(self.recently_applied) > RECENTLY_APPLIED:
                self.recently_applied.popitem(last=False)
        if self.on_change:
            self.on_change(schedule_id, entry, written)

    def _remove(self, schedule_id: str, written: Written | None = None) -> None:
        self.invalid.pop(schedule_id, None)
        if self.entries.pop(schedule_id, None) is not None:
            self._digest = None
            if self.on_change:
                self.on_change(schedule_id, None, written)

    def apply(self, event: dict[str, Any]) -> str:
        key = event.get("documentKey", {}).get("_id")
        current = self.entries.get(key) if key is not None else None
        action, schedule_id, detail = decide(event, current.revision if current else None)
        if action == "upsert":
            assert isinstance(detail, dict)
            # A new schedule's creation time; a change to one is planned from its commit.
            created = (
                _date(detail.get("created_at")) if event.get("operationType") == "insert" else None
            )
            self._put(schedule_id, detail, written=Written(_date(event.get("wallTime")), created))
        elif action == "remove":
            self._remove(schedule_id, Written(_date(event.get("wallTime")), None))
        self._applied(event)
        return action

    def load(self, docs: Iterable[dict[str, Any]]) -> tuple[int, int]:
        """Replace the mirror's content with ``docs``, touching only what changed.

        Returns (changed, removed).
        """
        seen: set[str] = set()
        changed = self._absorb(docs, seen)
        return changed, self._drop_unseen(seen)

    def _absorb(self, docs: Iterable[dict[str, Any]], seen: set[str]) -> int:
        """Put those of ``docs`` whose revision differs, noting every id in ``seen``;
        how many were put. A document carrying its write times (a resync's) hands them on
        as a streamed change's: ``updated_at`` for when it was changed, and for a schedule
        new to the mirror ``created_at`` (replan_from in dispatch.py)."""
        changed = 0
        entries = self.entries
        for doc in docs:
            schedule_id = doc["_id"]
            seen.add(schedule_id)
            current = entries.get(schedule_id)
            if current is None or current.revision != doc.get("revision"):
                written = None
                if "updated_at" in doc:
                    written = Written(
                        _date(doc["updated_at"]), None if current else _date(doc.get("created_at"))
                    )
                self._put(schedule_id, doc, streamed=False, written=written)
                changed += 1
        return changed

    def _drop_unseen(self, seen: set[str]) -> int:
        gone = [s for s in self.entries if s not in seen]
        for schedule_id in gone:
            self._remove(schedule_id)
        return len(gone)

    async def _load_all(self) -> tuple[int, int]:
        seen: set[str] = set()
        changed = 0
        projection = {"payload": 0, "name": 0, "labels": 0}
        if not self.resyncs:
            # The first load's write times would be read for nothing: no term leads on a
            # mirror not yet in sync. A resync's are the only record of what was written
            # while the stream was lost: a one-off created then, its instant passed before
            # the resync, is fired late rather than never.
            projection |= {"created_at": 0, "updated_at": 0}
        cursor = read_all(self._coll, projection, LOAD_BATCH)
        async for docs in read_ahead(cursor):
            changed += self._absorb(docs, seen)
        return changed, self._drop_unseen(seen)
