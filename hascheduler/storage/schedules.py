"""Schedules in MongoDB: the one source of truth, written with an atomic revision.

Works with a PyMongo ``AsyncCollection`` or a Motor ``AsyncIOMotorCollection``: both offer
the coroutine methods used here. Every write increments ``revision`` in the same atomic
update; writes that name an expected revision (HTTP If-Match) filter on it, so two
concurrent writers with the same expectation cannot both win.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError

from hascheduler.core import history
from hascheduler.core.constants import MAX_PAGE
from hascheduler.core.errors import RevisionConflict, ScheduleExists, ScheduleNotFound
from hascheduler.core.fields import DEFAULT_NAMESPACE
from hascheduler.core.history import (
    COMPLETE,
    CREATE,
    DELETE,
    PAUSE,
    RESUME,
    UPDATE,
    Actor,
)
from hascheduler.core.instants import as_utc, as_utc_deep
from hascheduler.core.models import Schedule, ScheduleFields, ScheduleIn
from hascheduler.core.specs import IntervalSpec
from hascheduler.storage.audit_log import (
    DELETED,
    LIVE,
    OUTBOX,
    PENDING,
    AuditLog,
    recording,
    with_record,
)
from hascheduler.storage.bulk import insert_new
from hascheduler.storage.collection import Collection
from hascheduler.storage.fire_counts import FireCounts

_FIELDS = frozenset(ScheduleFields.model_fields)
# Changes the cluster makes itself, and writes made without a caller (tests, tools).
SYSTEM = Actor("hascheduler")


# The traceparent of the write that last changed a schedule (process/tracing.py).
TRACE = "trace"
_NOT_SCHEDULE = frozenset({"_id", OUTBOX, PENDING, DELETED, TRACE})


def from_document(doc: dict[str, Any]) -> Schedule:
    """A stored document as a Schedule (dates read as UTC whatever the client's tz_aware)."""
    data = as_utc_deep({k: v for k, v in doc.items() if k not in _NOT_SCHEDULE})
    data["id"] = doc["_id"]
    return Schedule.model_validate(data, context={"stored": True})


def _fields_document(fields: ScheduleFields, now: dt.datetime) -> dict[str, Any]:
    trigger = fields.trigger
    if isinstance(trigger, IntervalSpec) and trigger.start_at is None:
        # Anchor the interval grid now, once: the phase is then fixed for good.
        trigger = trigger.model_copy(update={"start_at": _ms(now)})
    doc = fields.model_copy(update={"trigger": trigger}).model_dump(
        mode="python", include=set(_FIELDS)
    )
    return doc


# A span around one write of ``count`` schedules, named for its action, as the current
# span; it gives the span's W3C traceparent (None when untraced), which the write stores.
WriteTracer = Callable[[str, int], AbstractContextManager[str | None]]


def _untraced(action: str, count: int) -> AbstractContextManager[str | None]:
    return contextlib.nullcontext()


def _with_trace(doc: dict[str, Any], trace: str | None) -> dict[str, Any]:
    """Each fire of a schedule links to the trace of the write that last changed it."""
    return doc if trace is None else {**doc, TRACE: trace}


def _ms(moment: dt.datetime) -> dt.datetime:
    """BSON dates hold milliseconds; round here so what we return is what we store."""
    return moment.replace(microsecond=moment.microsecond // 1000 * 1000)


# The schedule as a client sees it, in an audit record's before and after.
_VIEW = _FIELDS | {"pause", "completed"}
# A write that lost a race with another (no revision was expected) is planned again from
# what the other left, this many times.
_RACES = 5
Changes = tuple[dict[str, Any], tuple[str, ...]]  # fields to set, fields to remove


def _stored_namespaces(namespaces: list[str]) -> list[str | None]:
    """As a query matches them: schedules stored before namespaces existed have none, and
    are in the default one."""
    return [*namespaces, *([None] if DEFAULT_NAMESPACE in namespaces else [])]


def _view(doc: dict[str, Any]) -> dict[str, Any]:
    return from_document(doc).model_dump(mode="json", include=set(_VIEW))


class ScheduleStore:
    """Every write records who made it, in the same write (storage/audit_log.py)."""

    def __init__(
        self,
        collection: Collection,
        counts: FireCounts | None = None,
        audit: AuditLog | None = None,
        redact_payload: bool = False,
        traced: WriteTracer = _untraced,
    ) -> None:
        self._coll = collection
        self._counts = counts  # fires used against max_fires (None: not shown, no revival)
        self._audit = audit
        self._redact = redact_payload
        self._traced = traced

    def _written(self) -> None:
        if self._audit is not None:
            self._audit.wake()

    def _record(
        self,
        action: str,
        actor: Actor,
        at: dt.datetime,
        namespace: str,
        schedule_id: str,
        revision: int | None,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        incarnation: dt.datetime | None,
    ) -> dict[str, Any]:
        made = history.record(
            action, actor, at, namespace, schedule_id, revision, before, after, redact=self._redact
        )
        return history.of_incarnation(made, incarnation)

    async def _with_remaining(self, schedule: Schedule) -> Schedule:
        if schedule.max_fires is None or self._counts is None:
            return schedule
        used = await self._counts.used(schedule.id)
        return schedule.model_copy(update={"fires_remaining": max(0, schedule.max_fires - used)})

    async def ensure_indexes(self) -> None:
        await self._coll.create_index([("paused", 1)], name="paused")
        await self._coll.create_index([("namespace", 1), ("_id", 1)], name="namespace")
        # A leader's catch-up reads the schedules written since the last watermark.
        await self._coll.create_index([("created_at", 1)], name="created_at")

    def _new_document(
        self, new: ScheduleIn, now: dt.datetime, actor: Actor, trace: str | None
    ) -> dict[str, Any]:
        doc = _with_trace(
            {
                "_id": new.id or uuid.uuid4().hex,
                **_fields_document(new, now),
                "created_at": now,
                "updated_at": now,
                "revision": 1,
            },
            trace,
        )
        return with_record(
            doc,
            self._record(CREATE, actor, now, new.namespace, doc["_id"], 1, None, _view(doc), now),
        )

    async def create(self, new: ScheduleIn, now: dt.datetime, actor: Actor = SYSTEM) -> Schedule:
        """Insert a schedule at revision 1. Raises ScheduleExists."""
        with self._traced(CREATE, 1) as trace:
            doc = self._new_document(new, _ms(now), actor, trace)
            for attempt in range(2):
                try:
                    await self._coll.insert_one(doc)
                    break
                except DuplicateKeyError:
                    if attempt or not await self._settled_tombstones([doc["_id"]]):
                        raise ScheduleExists(doc["_id"]) from None
        self._written()
        return await self._with_remaining(from_document(doc))

    async def _settled_tombstones(self, ids: list[str]) -> bool:
        """Whether any of ``ids`` was a deleted schedule waiting for its record to be
        copied; if so, its record is copied now and the id is free. One the relay took
        between the insert and this look is free already: so is one of ``ids`` no
        document holds any more."""
        if self._audit is None:
            return False
        if await self._coll.find_one({"_id": {"$in": ids}, DELETED: True}, {"_id": 1}) is None:
            held = {d["_id"] async for d in self._coll.find({"_id": {"$in": ids}}, {"_id": 1})}
            return len(held) < len(set(ids))
        await self._audit.relay()
        return True

    async def create_many(
        self, news: list[ScheduleIn], now: dt.datetime, actor: Actor = SYSTEM
    ) -> tuple[list[str], list[str]]:
        """Insert each at revision 1, in one round trip: the ids created, and those that
        were taken already (left as they were)."""
        now = _ms(now)
        with self._traced(CREATE, len(news)) as trace:
            docs = [self._new_document(new, now, actor, trace) for new in news]
            taken = {docs[e["index"]]["_id"] for e in await insert_new(self._coll, docs)}
            if taken and await self._settled_tombstones(sorted(taken)):
                retried = [d for d in docs if d["_id"] in taken]
                taken = {retried[e["index"]]["_id"] for e in await insert_new(self._coll, retried)}
        self._written()
        return [d["_id"] for d in docs if d["_id"] not in taken], sorted(taken)

    async def message_fields(self, ids: list[str]) -> list[dict[str, Any]]:
        """What a fire's message carries of each of these schedules still stored (name,
        target, payload, run control, the trace of its last write), with its revision."""
        return [
            d
            async for d in self._coll.find(
                {"_id": {"$in": ids}},
                {
                    "name": 1,
                    "namespace": 1,
                    "payload": 1,
                    "target": 1,
                    "revision": 1,
                    TRACE: 1,
                    "concurrency": 1,
                    "rate": 1,
                    "priority": 1,
                },
            )
        ]

    async def created_after(self, after: dt.datetime) -> dict[str, dt.datetime]:
        """When each schedule created after ``after`` was created: a range of the
        ``created_at`` index, on dates only (a stored value of another type matches
        nothing)."""
        return {
            doc["_id"]: as_utc(doc["created_at"])
            async for doc in self._coll.find({"created_at": {"$gt": after}}, {"created_at": 1})
        }

    async def get(self, schedule_id: str) -> Schedule:
        """Raises ScheduleNotFound."""
        doc = await self._coll.find_one({"_id": schedule_id, **LIVE}, {OUTBOX: 0})
        if doc is None:
            raise ScheduleNotFound(schedule_id)
        return await self._with_remaining(from_document(doc))

    async def get_many(self, schedule_ids: list[str]) -> list[Schedule]:
        """The live schedules of these ids, in id order (those gone are left out): one
        query by _id a page at a time."""
        found: list[Schedule] = []
        for start in range(0, len(schedule_ids), MAX_PAGE):
            page = schedule_ids[start : start + MAX_PAGE]
            found += [
                from_document(d)
                async for d in self._coll.find({"_id": {"$in": page}, **LIVE}, {OUTBOX: 0}).sort(
                    "_id", 1
                )
            ]
        return found

    async def paused_since(self, since: dt.datetime, limit: int) -> list[dict[str, Any]]:
        """Schedules paused (still) by a pause made at or after ``since``: id, namespace,
        pause."""
        return [
            d
            async for d in self._coll.find(
                {"paused": True, "pause.at": {"$gte": since}, **LIVE}, {"namespace": 1, "pause": 1}
            )
            .sort("pause.at", 1)
            .limit(limit)
        ]

    async def namespace_of(self, schedule_id: str) -> str | None:
        """The namespace of a schedule, or None when there is no such schedule."""
        doc = await self._coll.find_one({"_id": schedule_id, **LIVE}, {"namespace": 1})
        return None if doc is None else str(doc.get("namespace", DEFAULT_NAMESPACE))

    async def ids_in(self, namespaces: list[str]) -> list[str]:
        """The ids of the schedules in these namespaces."""
        return [
            d["_id"]
            async for d in self._coll.find(
                {"namespace": {"$in": _stored_namespaces(namespaces)}, **LIVE}, {"_id": 1}
            )
        ]

    async def count(self, namespace: str) -> int:
        return int(
            await self._coll.count_documents(
                {"namespace": {"$in": _stored_namespaces([namespace])}, **LIVE}
            )
        )

    async def list(
        self,
        *,
        labels: dict[str, str] | None = None,
        paused: bool | None = None,
        after: str | None = None,
        limit: int = 100,
        namespaces: list[str] | None = None,
    ) -> tuple[list[Schedule], str | None]:
        """One page in id order, and the id to pass as ``after`` for the next (or None)."""
        query: dict[str, Any] = {f"labels.{k}": v for k, v in (labels or {}).items()}
        query.update(LIVE)
        if namespaces is not None:
            query["namespace"] = {"$in": _stored_namespaces(namespaces)}
        if paused is not None:
            query["paused"] = paused
        if after is not None:
            query["_id"] = {"$gt": after}
        cursor = self._coll.find(query, {OUTBOX: 0}).sort("_id", 1).limit(limit + 1)
        docs = [doc async for doc in cursor]
        items = [from_document(d) for d in docs[:limit]]
        return items, (items[-1].id if len(docs) > limit else None)

    async def _change(
        self,
        schedule_id: str,
        action: str,
        actor: Actor,
        now: dt.datetime,
        changes: Callable[[dict[str, Any]], Changes | None],
        expected_revision: int | None = None,
    ) -> dict[str, Any] | None:
        """Change one schedule and record it, in one write guarded by the revision read:
        the record's ``before`` is exactly what the write replaced. ``changes`` says what
        to set and remove given the current document, or None to leave it (the write's
        condition does not hold: None is returned). Raises ScheduleNotFound,
        RevisionConflict."""
        with self._traced(action, 1) as trace:
            return await self._write_change(
                schedule_id, action, actor, now, changes, expected_revision, trace
            )

    async def _write_change(
        self,
        schedule_id: str,
        action: str,
        actor: Actor,
        now: dt.datetime,
        changes: Callable[[dict[str, Any]], Changes | None],
        expected_revision: int | None,
        trace: str | None,
    ) -> dict[str, Any] | None:
        for _ in range(_RACES):
            current = await self._coll.find_one({"_id": schedule_id, **LIVE}, {OUTBOX: 0})
            if current is None:
                raise ScheduleNotFound(schedule_id)
            revision = int(current["revision"])
            if expected_revision is not None and revision != expected_revision:
                raise RevisionConflict(schedule_id, expected_revision, revision)
            wanted = changes(current)
            if wanted is None:
                return None
            sets, unsets = wanted
            deleting = action == DELETE
            after = (
                None
                if deleting
                else _view({**{k: v for k, v in current.items() if k not in unsets}, **sets})
            )
            record = self._record(
                action,
                actor,
                now,
                str(current.get("namespace", DEFAULT_NAMESPACE)),
                schedule_id,
                revision + 1,
                _view(current),
                after,
                current.get("created_at"),
            )
            update: dict[str, Any] = {"$set": _with_trace(sets, trace), "$inc": {"revision": 1}}
            if unsets:
                update["$unset"] = dict.fromkeys(unsets, "")
            doc = await self._coll.find_one_and_update(
                {"_id": schedule_id, "revision": revision, **LIVE},
                recording(update, record),
                projection={OUTBOX: 0},
                return_document=ReturnDocument.AFTER,
            )
            if doc is not None:
                self._written()
                return dict(doc)
            if expected_revision is not None:
                await self._raise_missing_or_conflict(schedule_id, expected_revision)
        raise RevisionConflict(schedule_id, 0, revision)

    async def replace(
        self,
        schedule_id: str,
        fields: ScheduleFields,
        now: dt.datetime,
        expected_revision: int | None = None,
        actor: Actor = SYSTEM,
        action: str = UPDATE,
    ) -> Schedule:
        """Replace every client field. Raises ScheduleNotFound, RevisionConflict."""
        now = _ms(now)
        # Completed only while its fires used reach max_fires: raising it revives it.
        used = await self._counts.used(schedule_id) if self._counts is not None else 0
        completed = fields.max_fires is not None and used >= fields.max_fires
        # Resumed by the write: the record of the pause goes with it.
        changes = (
            {**_fields_document(fields, now), "updated_at": now, "completed": completed},
            () if fields.paused else ("pause",),
        )
        doc = await self._change(
            schedule_id, action, actor, now, lambda _: changes, expected_revision
        )
        assert doc is not None
        return await self._with_remaining(from_document(doc))

    async def complete(
        self, schedule_id: str, max_fires: int, now: dt.datetime, actor: Actor = SYSTEM
    ) -> bool:
        """Its ``max_fires`` fires are used (the leader): completed, unless max_fires
        changed meanwhile."""
        now = _ms(now)
        try:
            doc = await self._change(
                schedule_id,
                COMPLETE,
                actor,
                now,
                lambda d: (
                    ({"completed": True, "updated_at": now}, ())
                    if d.get("max_fires") == max_fires and not d.get("completed")
                    else None
                ),
            )
        except ScheduleNotFound:
            return False
        return doc is not None

    async def pause(
        self,
        schedule_id: str,
        now: dt.datetime,
        actor: Actor,
        note: str | None = None,
        until: dt.datetime | None = None,
        expected_revision: int | None = None,
    ) -> Schedule:
        """Pause, recording who, when, why and until when."""
        now = _ms(now)
        pause: dict[str, Any] = {"by": actor.name, "at": now}
        if note is not None:
            pause["note"] = note
        if until is not None:
            pause["until"] = _ms(until)
        doc = await self._change(
            schedule_id,
            PAUSE,
            actor,
            now,
            lambda _: ({"paused": True, "pause": pause, "updated_at": now}, ()),
            expected_revision,
        )
        assert doc is not None
        return from_document(doc)

    async def pause_unless_paused(
        self, schedule_id: str, now: dt.datetime, by: str, note: str
    ) -> bool:
        """Pause a running schedule (pause_on_failure); False if it was paused already."""
        now = _ms(now)
        try:
            doc = await self._change(
                schedule_id,
                PAUSE,
                Actor(by, reason=note),
                now,
                lambda d: (
                    None
                    if d.get("paused")
                    else (
                        {
                            "paused": True,
                            "pause": {"by": by, "at": now, "note": note},
                            "updated_at": now,
                        },
                        (),
                    )
                ),
            )
        except ScheduleNotFound:
            return False
        return doc is not None

    async def resume(
        self,
        schedule_id: str,
        now: dt.datetime,
        expected_revision: int | None = None,
        actor: Actor = SYSTEM,
    ) -> Schedule:
        now = _ms(now)
        doc = await self._change(
            schedule_id,
            RESUME,
            actor,
            now,
            lambda _: ({"paused": False, "updated_at": now}, ("pause",)),
            expected_revision,
        )
        assert doc is not None
        return from_document(doc)

    async def resume_at_end(
        self, schedule_id: str, until: dt.datetime, now: dt.datetime, actor: Actor = SYSTEM
    ) -> bool:
        """Resume a schedule paused until ``until`` (the leader, once it has passed);
        False when it was resumed, paused again or changed meanwhile."""
        now, until = _ms(now), _ms(until)

        def ended(d: dict[str, Any]) -> Changes | None:
            pause = d.get("pause") or {}
            if not d.get("paused") or as_utc(pause.get("until")) != until:
                return None
            return {"paused": False, "updated_at": now}, ("pause",)

        try:
            return await self._change(schedule_id, RESUME, actor, now, ended) is not None
        except ScheduleNotFound:
            return False

    async def pause_on_failure_of(self, schedule_id: str) -> int | None:
        """The schedule's pause_on_failure while it runs (None: unset, paused or gone)."""
        doc = await self._coll.find_one(
            {"_id": schedule_id, "paused": False, **LIVE}, {"pause_on_failure": 1}
        )
        limit = doc.get("pause_on_failure") if doc else None
        return int(limit) if isinstance(limit, int) else None

    async def delete(
        self,
        schedule_id: str,
        expected_revision: int | None = None,
        actor: Actor = SYSTEM,
        now: dt.datetime | None = None,
    ) -> None:
        """Delete: a tombstone carrying the record until the trail has it (then gone).
        Raises ScheduleNotFound, RevisionConflict."""
        at = _ms(now or dt.datetime.now(dt.UTC))
        await self._change(
            schedule_id,
            DELETE,
            actor,
            at,
            lambda _: ({DELETED: True, "updated_at": at}, ()),
            expected_revision,
        )

    async def _raise_missing_or_conflict(
        self, schedule_id: str, expected_revision: int | None
    ) -> None:
        current = await self._coll.find_one({"_id": schedule_id, **LIVE}, {"revision": 1})
        if current is None:
            raise ScheduleNotFound(schedule_id)
        raise RevisionConflict(schedule_id, expected_revision or 0, int(current["revision"]))
