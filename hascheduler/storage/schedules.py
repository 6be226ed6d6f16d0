"""Schedules in MongoDB: the one source of truth, written with an atomic revision.

Works with a PyMongo ``AsyncCollection`` or a Motor ``AsyncIOMotorCollection``: both offer
the coroutine methods used here. Every write increments ``revision`` in the same atomic
update; writes that name an expected revision (HTTP If-Match) filter on it, so two
concurrent writers with the same expectation cannot both win.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any, Protocol

from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError

from hascheduler.core.errors import RevisionConflict, ScheduleExists, ScheduleNotFound
from hascheduler.core.instants import as_utc_deep
from hascheduler.core.models import IntervalSpec, Schedule, ScheduleFields, ScheduleIn
from hascheduler.storage.bulk import insert_new
from hascheduler.storage.fire_counts import FireCounts

_FIELDS = frozenset(ScheduleFields.model_fields)


class Collection(Protocol):
    """The slice of a driver collection the store uses (PyMongo async or Motor)."""

    async def insert_one(self, document: Any) -> Any: ...
    async def insert_many(self, documents: Any, *args: Any, **kwargs: Any) -> Any: ...
    async def find_one(self, filter: Any, *args: Any, **kwargs: Any) -> Any: ...
    async def find_one_and_update(self, filter: Any, update: Any, *args: Any,
                                  **kwargs: Any) -> Any: ...
    async def delete_one(self, filter: Any) -> Any: ...
    async def create_index(self, keys: Any, **kwargs: Any) -> Any: ...
    def find(self, *args: Any, **kwargs: Any) -> Any: ...


def from_document(doc: dict[str, Any]) -> Schedule:
    """A stored document as a Schedule (dates read as UTC whatever the client's tz_aware)."""
    data = as_utc_deep({k: v for k, v in doc.items() if k != "_id"})
    data["id"] = doc["_id"]
    return Schedule.model_validate(data, context={"stored": True})


def _fields_document(fields: ScheduleFields, now: dt.datetime) -> dict[str, Any]:
    trigger = fields.trigger
    if isinstance(trigger, IntervalSpec) and trigger.start_at is None:
        # Anchor the interval grid now, once: the phase is then fixed for good.
        trigger = trigger.model_copy(update={"start_at": _ms(now)})
    doc = fields.model_copy(update={"trigger": trigger}).model_dump(
        mode="python", include=set(_FIELDS))
    return doc


def _ms(moment: dt.datetime) -> dt.datetime:
    """BSON dates hold milliseconds; round here so what we return is what we store."""
    return moment.replace(microsecond=moment.microsecond // 1000 * 1000)


class ScheduleStore:
    def __init__(self, collection: Collection, counts: FireCounts | None = None) -> None:
        self._coll = collection
        self._counts = counts  # fires used against max_fires (None: not shown, no revival)

    async def _with_remaining(self, schedule: Schedule) -> Schedule:
        if schedule.max_fires is None or self._counts is None:
            return schedule
        used = await self._counts.used(schedule.id)
        return schedule.model_copy(update={"fires_remaining": max(0, schedule.max_fires - used)})

    async def ensure_indexes(self) -> None:
        await self._coll.create_index([("paused", 1)], name="paused")

    async def create(self, new: ScheduleIn, now: dt.datetime) -> Schedule:
        """Insert a schedule at revision 1. Raises ScheduleExists."""
        schedule_id = new.id or uuid.uuid4().hex
        now = _ms(now)
        doc = {"_id": schedule_id, **_fields_document(new, now), "created_at": now,
               "updated_at": now, "revision": 1}
        try:
            await self._coll.insert_one(doc)
        except DuplicateKeyError:
            raise ScheduleExists(schedule_id) from None
        return await self._with_remaining(from_document(doc))

    async def create_many(self, news: list[ScheduleIn], now: dt.datetime
                          ) -> tuple[list[str], list[str]]:
        """Insert each at revision 1, in one round trip: the ids created, and those that
        were taken already (left as they were)."""
        now = _ms(now)
        docs = [{"_id": new.id or uuid.uuid4().hex, **_fields_document(new, now),
                 "created_at": now, "updated_at": now, "revision": 1} for new in news]
        taken = {docs[e["index"]]["_id"] for e in await insert_new(self._coll, docs)}
        return [d["_id"] for d in docs if d["_id"] not in taken], sorted(taken)

    async def get(self, schedule_id: str) -> Schedule:
        """Raises ScheduleNotFound."""
        doc = await self._coll.find_one({"_id": schedule_id})
        if doc is None:
            raise ScheduleNotFound(schedule_id)
        return await self._with_remaining(from_document(doc))

    async def list(self, *, labels: dict[str, str] | None = None, paused: bool | None = None,
                   after: str | None = None, limit: int = 100) -> tuple[list[Schedule],
                                                                         str | None]:
        """One page in id order, and the id to pass as ``after`` for the next (or None)."""
        query: dict[str, Any] = {f"labels.{k}": v for k, v in (labels or {}).items()}
        if paused is not None:
            query["paused"] = paused
        if after is not None:
            query["_id"] = {"$gt": after}
        cursor = self._coll.find(query).sort("_id", 1).limit(limit + 1)
        docs = [doc async for doc in cursor]
        items = [from_document(d) for d in docs[:limit]]
        return items, (items[-1].id if len(docs) > limit else None)

    async def replace(self, schedule_id: str, fields: ScheduleFields, now: dt.datetime,
                      expected_revision: int | None = None) -> Schedule:
        """Replace every client field. Raises ScheduleNotFound, RevisionConflict."""
        now = _ms(now)
        # Completed only while its fires used reach max_fires: raising it revives it.
        used = await self._counts.used(schedule_id) if self._counts is not None else 0
        completed = fields.max_fires is not None and used >= fields.max_fires
        # Resumed by the write: the record of the pause goes with it.
        return await self._with_remaining(await self._update(
            schedule_id, {**_fields_document(fields, now), "updated_at": now,
                          "completed": completed}, expected_revision,
            unset=() if fields.paused else ("pause",)))

    async def complete(self, schedule_id: str, max_fires: int, now: dt.datetime) -> bool:
        """Its ``max_fires`` fires are used (the leader): completed, unless max_fires
        changed meanwhile."""
        doc = await self._coll.find_one_and_update(
            {"_id": schedule_id, "max_fires": max_fires, "completed": {"$ne": True}},
            {"$set": {"completed": True, "updated_at": _ms(now)}, "$inc": {"revision": 1}})
        return doc is not None

    async def pause(self, schedule_id: str, now: dt.datetime, by: str,
                    note: str | None = None, until: dt.datetime | None = None,
                    expected_revision: int | None = None) -> Schedule:
        """Pause, recording who, when, why and until when."""
        now = _ms(now)
        pause: dict[str, Any] = {"by": by, "at": now}
        if note is not None:
            pause["note"] = note
        if until is not None:
            pause["until"] = _ms(until)
        return await self._update(schedule_id, {"paused": True, "pause": pause,
                                                "updated_at": now}, expected_revision)

    async def pause_unless_paused(self, schedule_id: str, now: dt.datetime, by: str,
                                  note: str) -> bool:
        """Pause a running schedule (pause_on_failure); False if it was paused already."""
        doc = await self._coll.find_one_and_update(
            {"_id": schedule_id, "paused": False},
            {"$set": {"paused": True, "pause": {"by": by, "at": _ms(now), "note": note},
                      "updated_at": _ms(now)}, "$inc": {"revision": 1}})
        return doc is not None

    async def resume(self, schedule_id: str, now: dt.datetime,
                     expected_revision: int | None = None) -> Schedule:
        return await self._update(schedule_id, {"paused": False, "updated_at": _ms(now)},
                                  expected_revision, unset=("pause",))

    async def resume_at_end(self, schedule_id: str, until: dt.datetime,
                            now: dt.datetime) -> bool:
        """Resume a schedule paused until ``until`` (the leader, once it has passed);
        False when it was resumed, paused again or changed meanwhile."""
        doc = await self._coll.find_one_and_update(
            {"_id": schedule_id, "paused": True, "pause.until": _ms(until)},
            {"$set": {"paused": False, "updated_at": _ms(now)}, "$unset": {"pause": ""},
             "$inc": {"revision": 1}})
        return doc is not None

    async def pause_on_failure_of(self, schedule_id: str) -> int | None:
        """The schedule's pause_on_failure while it runs (None: unset, paused or gone)."""
        doc = await self._coll.find_one({"_id": schedule_id, "paused": False},
                                        {"pause_on_failure": 1})
        limit = doc.get("pause_on_failure") if doc else None
        return int(limit) if isinstance(limit, int) else None

    async def _update(self, schedule_id: str, changes: dict[str, Any],
                      expected_revision: int | None, unset: tuple[str, ...] = ()) -> Schedule:
        query: dict[str, Any] = {"_id": schedule_id}
        if expected_revision is not None:
            query["revision"] = expected_revision
        update: dict[str, Any] = {"$set": changes, "$inc": {"revision": 1}}
        if unset:
            update["$unset"] = dict.fromkeys(unset, "")
        doc = await self._coll.find_one_and_update(query, update,
                                                   return_document=ReturnDocument.AFTER)
        if doc is None:
            await self._raise_missing_or_conflict(schedule_id, expected_revision)
        return from_document(doc)

    async def delete(self, schedule_id: str, expected_revision: int | None = None) -> None:
        """Raises ScheduleNotFound, RevisionConflict."""
        query: dict[str, Any] = {"_id": schedule_id}
        if expected_revision is not None:
            query["revision"] = expected_revision
        result = await self._coll.delete_one(query)
        if result.deleted_count == 0:
            await self._raise_missing_or_conflict(schedule_id, expected_revision)

    async def _raise_missing_or_conflict(self, schedule_id: str,
                                         expected_revision: int | None) -> None:
        current = await self._coll.find_one({"_id": schedule_id}, {"revision": 1})
        if current is None:
            raise ScheduleNotFound(schedule_id)
        raise RevisionConflict(schedule_id, expected_revision or 0, int(current["revision"]))
