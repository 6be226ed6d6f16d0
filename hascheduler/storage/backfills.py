"""Backfills: the ``backfills`` collection, one document per request to fire a schedule's
nominal times in a past range (POST /schedules/{id}/backfill), worked by the leader a chunk
at a time (replica/dispatch.py) and so carried across failovers.

A backfill is ``running`` -> ``done`` | ``cancelled``. ``cursor`` is the first nominal time
not yet handled; the leader advances it after each chunk, adding what it fired (claims it
made and published), what it skipped (times the ledger already held) and what was
withdrawn at its publish (the schedule deleted or changed, its overlap policy, max_fires),
each counted from the ledger (core/backfill.py). Fire ids are the ordinary
``<id>@<nominal>``: a time fired before, by the trigger or another backfill, is never fired
again. A backfill waits while its schedule is paused, and its claims a pause withdrew
before their publish are freed and fired after the resume.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from pydantic import BaseModel, Field
from pymongo import ASCENDING, ReturnDocument

from hascheduler.core.instants import as_utc
from hascheduler.storage.audit_log import recording, with_record
from hascheduler.storage.collection import Collection

RUNNING = "running"
DONE = "done"
CANCELLED = "cancelled"

Document = dict[str, Any]


class Backfill(BaseModel):
    """A backfill as the API shows it."""

    id: str
    schedule_id: str
    start: dt.datetime
    end: dt.datetime = Field(description="exclusive")
    overlap: str | None = None
    state: str = Field(description="running, done or cancelled")
    total: int = Field(description="nominal times in [start, end)")
    fired: int
    skipped: int = Field(
        description="times the ledger already held: fired or recorded "
        "before, by the trigger or another backfill"
    )
    withdrawn: int = Field(
        0,
        description="times this backfill claimed and skipped at their "
        "publish (withdrawn_reasons says why)",
    )
    withdrawn_reasons: list[str] = Field(default_factory=list)
    remaining: int
    requested_by: str
    created_at: dt.datetime
    finished_at: dt.datetime | None = None

    @classmethod
    def of(cls, doc: Document) -> Backfill:
        fields = {k: as_utc(v) if isinstance(v, dt.datetime) else v for k, v in doc.items()}
        return cls(
            id=doc["_id"],
            remaining=max(
                0, doc["total"] - doc["fired"] - doc["skipped"] - doc.get("withdrawn", 0)
            ),
            **{k: v for k, v in fields.items() if k in cls.model_fields and k != "id"},
        )


class Backfills:
    def __init__(self, collection: Collection) -> None:
        self.coll = collection

    async def ensure_indexes(self) -> None:
        await self.coll.create_index(
            [("created_at", ASCENDING)], name="running", partialFilterExpression={"state": RUNNING}
        )

    async def create(
        self,
        schedule_id: str,
        start: dt.datetime,
        end: dt.datetime,
        overlap: str | None,
        total: int,
        by: str,
        now: dt.datetime,
        record: Document | None = None,
    ) -> Document:
        """A backfill of a schedule, kept in the namespace its ``record`` names (the
        schedule's): who reads it does not change when the schedule is deleted."""
        doc: Document = {
            "_id": uuid.uuid4().hex,
            "schedule_id": schedule_id,
            "start": start,
            "end": end,
            "overlap": overlap,
            "state": RUNNING,
            "cursor": start,
            "total": total,
            "fired": 0,
            "skipped": 0,
            "withdrawn": 0,
            "withdrawn_reasons": [],
            "requested_by": by,
            "created_at": now,
        }
        if record is not None:
            doc["namespace"] = record["namespace"]
        await self.coll.insert_one(doc if record is None else with_record(doc, record))
        return doc

    async def get(self, backfill_id: str) -> Document | None:
        doc: Document | None = await self.coll.find_one({"_id": backfill_id})
        return doc

    async def cancel(
        self, backfill_id: str, now: dt.datetime, record: Document | None = None
    ) -> Document | None:
        """Stop a running backfill; None when it is not running (or not there)."""
        change: Document = {"$set": {"state": CANCELLED, "finished_at": now}}
        doc: Document | None = await self.coll.find_one_and_update(
            {"_id": backfill_id, "state": RUNNING},
            change if record is None else recording(change, record),
            return_document=ReturnDocument.AFTER,
        )
        return doc

    async def running(self, limit: int) -> list[Document]:
        """Running backfills, oldest first."""
        return [
            d
            async for d in self.coll.find({"state": RUNNING})
            .sort("created_at", ASCENDING)
            .limit(limit)
        ]

    async def advance(
        self,
        backfill_id: str,
        cursor: dt.datetime,
        fired: int,
        skipped: int,
        done: bool,
        now: dt.datetime,
        withdrawn: dict[str, int] | None = None,
    ) -> None:
        """Record a chunk handled (only while the backfill still runs: a cancel stands)."""
        changes: Document = {"cursor": cursor}
        if done:
            changes.update(state=DONE, finished_at=now)
        withdrawn = withdrawn or {}
        update: Document = {
            "$set": changes,
            "$inc": {"fired": fired, "skipped": skipped, "withdrawn": sum(withdrawn.values())},
        }
        if withdrawn:
            update["$addToSet"] = {"withdrawn_reasons": {"$each": sorted(withdrawn)}}
        await self.coll.update_one({"_id": backfill_id, "state": RUNNING}, update)
