"""The audit trail in MongoDB: records written with their change, then moved to their own
collection.

MongoDB makes one document's write atomic, not two documents' (and the development
server has no transactions), so a change's record rides in the changed document itself:
pushed onto its ``audit_outbox`` and flagged ``audit_pending`` in the same update or
insert. The relay then copies pending records into ``audit`` (by record id: copying twice
is harmless) and clears them from the outbox (only the records it copied). A deleted
schedule stays as a tombstone (``deleted``) until its last record is copied, then goes.

Any replica relays: when it has just written (woken), every second otherwise, and before
it answers a read of the trail, so a reader sees every change that was acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from typing import Any

import structlog
from pymongo.errors import PyMongoError

from hascheduler.storage.bulk import insert_new
from hascheduler.storage.collection import Collection
from hascheduler.storage.pages import older_than

log = structlog.get_logger("hascheduler.audit")

OUTBOX = "audit_outbox"
PENDING = "audit_pending"
DELETED = "deleted"
# Documents that are not tombstones (add to every read of schedules).
LIVE: dict[str, Any] = {DELETED: {"$exists": False}}
# Pending documents copied per pass; more wait for the next.
RELAY_BATCH = 1000
RELAY_INTERVAL_S = 1.0
DEFAULT_RETENTION_DAYS = 400


def with_record(document: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """A document to insert, carrying the record of its own creation."""
    return {**document, OUTBOX: [record], PENDING: True}


def recording(update: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """An update (operators) that also pushes ``record`` onto the document's outbox."""
    return {
        **update,
        "$set": {**update.get("$set", {}), PENDING: True},
        "$push": {**update.get("$push", {}), OUTBOX: record},
    }


class AuditLog:
    def __init__(
        self,
        records: Collection,
        outboxes: list[Collection],
        retention_days: float = DEFAULT_RETENTION_DAYS,
    ) -> None:
        self.records = records
        self.outboxes = outboxes  # the collections whose writes carry their records
        self.retention_s = retention_days * 86400
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._lock = asyncio.Lock()

    async def ensure_indexes(self) -> None:
        for outbox in self.outboxes:
            # Partial: only the few documents with a record still to copy are in it.
            await outbox.create_index(
                [(PENDING, 1)], name="audit_pending", partialFilterExpression={PENDING: True}
            )
        await self.records.create_index(
            [("at", 1)], name="retention", expireAfterSeconds=int(self.retention_s)
        )
        for key in ("schedule_id", "namespace", "actor"):
            await self.records.create_index([(key, 1), ("at", -1)], name=f"{key}_at")

    async def insert(self, records: list[dict[str, Any]]) -> None:
        """Records of changes made outside the database (the access file's), straight
        into the trail; one already there (another replica's) stays as it is."""
        if records:
            await insert_new(self.records, records)

    def wake(self) -> None:
        """A change was just written: relay soon, with whatever else is pending."""
        self._wake.set()

    async def relay(self) -> int:
        """Copy every pending record into the trail; how many were copied."""
        async with self._lock:
            copied = 0
            for outbox in self.outboxes:
                copied += await self._relay(outbox)
            return copied

    async def _relay(self, outbox: Collection) -> int:
        docs = [
            d
            async for d in outbox.find({PENDING: True}, {OUTBOX: 1, DELETED: 1}).limit(RELAY_BATCH)
        ]
        records = [r for d in docs for r in d.get(OUTBOX) or ()]
        if records:
            await insert_new(self.records, records)  # a record copied before stays as it is
        for doc in docs:
            ids = [r["_id"] for r in doc.get(OUTBOX) or ()]
            if doc.get(DELETED):
                # A tombstone goes once its records are copied; a newer change (none can
                # follow a delete but another delete's retry) waits for the next pass.
                await outbox.delete_one(
                    {"_id": doc["_id"], f"{OUTBOX}._id": {"$all": ids}, OUTBOX: {"$size": len(ids)}}
                )
                continue
            cleared = await outbox.update_one(
                {"_id": doc["_id"], OUTBOX: {"$size": len(ids)}},
                {"$unset": {OUTBOX: "", PENDING: ""}},
            )
            if cleared.modified_count == 0:  # more were pushed since: remove what was copied
                await outbox.update_one(
                    {"_id": doc["_id"]}, {"$pull": {OUTBOX: {"_id": {"$in": ids}}}}
                )
        return len(records)

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    async def run(self) -> None:
        """Relay until stopped: when woken by a write, and every second."""
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), RELAY_INTERVAL_S)
            self._wake.clear()
            try:
                await self.relay()
            except PyMongoError as exc:
                log.warning("audit_relay_failed", error=str(exc))

    async def query(
        self,
        *,
        namespaces: list[str] | None = None,
        schedule_id: str | None = None,
        actor: str | None = None,
        since: dt.datetime | None = None,
        before: str | None = None,
        limit: int = 100,
        incarnation: dt.datetime | None = None,
    ) -> list[dict[str, Any]]:
        """Collection newest first; ``before``: the id of the last record of the previous
        page; ``incarnation``: of the schedule created then (and records that name none).
        Every pending record is relayed first."""
        await self.relay()
        query: dict[str, Any] = {}
        if namespaces is not None:
            query["namespace"] = {"$in": namespaces}
        if schedule_id is not None:
            query["schedule_id"] = schedule_id
        if incarnation is not None:
            query["incarnation"] = {"$in": [incarnation, None]}
        if actor is not None:
            query["actor"] = actor
        if since is not None:
            query["at"] = {"$gte": since}
        if before is not None:
            query.update(await older_than(self.records, "at", before))
        cursor = self.records.find(query).sort([("at", -1), ("_id", -1)]).limit(limit)
        return [doc async for doc in cursor]

    async def revision(
        self, schedule_id: str, revision: int, incarnation: dt.datetime, namespace: str
    ) -> dict[str, Any] | None:
        """The record whose change left the schedule created at ``incarnation`` (or one
        recorded before incarnations were) at ``revision`` in ``namespace``: never one of
        another namespace (an id reused there after a delete, or a schedule moved)."""
        await self.relay()
        doc = await self.records.find_one(
            {
                "schedule_id": schedule_id,
                "revision": revision,
                "after": {"$ne": None},
                "incarnation": {"$in": [incarnation, None]},
                "namespace": namespace,
            }
        )
        return None if doc is None else dict(doc)
