"""Records a lease history from the database's change stream, for core/lease_history.

One stream over the lease and the fires ledger: every change to the lease document (an
acquisition, a renewal, a release: each carries the server's ``$$NOW``), and every write
that puts a term on a fire (a claim, an adoption, a take, a skip), at the server's time of
the write (the event's ``wallTime``). It reads what the replicas wrote and shares no code
with them beyond the names of the collections, so it can check them.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import uuid
from typing import Any

from pymongo.errors import PyMongoError

from hascheduler.core.constants import FIRES, LEASE_HISTORY_MARKS, LEASE_NAME, LEASES
from hascheduler.core.instants import as_utc
from hascheduler.core.lease_history import Act, HistoryReport, TermRecord, check
from hascheduler.storage.lease import LeaseTimings
from hascheduler.storage.streams import open_change_stream

# Where ``settle`` writes the marks it waits to see come back on the stream.
MARKS = LEASE_HISTORY_MARKS


class LeaseHistory:
    """``async with LeaseHistory(db) as history``: records until the block ends; then
    ``history.check(timings)``."""

    def __init__(self, db: Any, lease_name: str = LEASE_NAME) -> None:
        self._db = db
        self._lease_name = lease_name
        self._lease: dict[str, Any] = {}
        self.terms: dict[int, TermRecord] = {}
        self.acts: list[Act] = []
        self._task: asyncio.Task[None] | None = None
        self._opened = asyncio.Event()
        self._marks: dict[str, asyncio.Event] = {}

    async def __aenter__(self) -> LeaseHistory:
        self._task = asyncio.create_task(self._record())
        await asyncio.wait_for(self._opened.wait(), 30)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.settle()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def settle(self, limit_s: float = 10.0) -> None:
        """Return once everything written before the call has been recorded: a mark is
        written, and the stream reaches it (at most ``limit_s``)."""
        mark = uuid.uuid4().hex
        self._marks[mark] = asyncio.Event()
        await self._db[MARKS].insert_one({"_id": mark})
        try:
            await asyncio.wait_for(self._marks[mark].wait(), limit_s)
        finally:
            del self._marks[mark]
            await self._db[MARKS].delete_one({"_id": mark})

    def check(self, timings: LeaseTimings) -> HistoryReport:
        """The history against the lease timings the replicas ran with."""
        return check(
            list(self.terms.values()), list(self.acts), timings.renew_deadline, timings.ttl
        )

    async def _record(self) -> None:
        pipeline = [{"$match": {"ns.coll": {"$in": [LEASES, FIRES, MARKS]}}}]
        token: Any = None
        while True:
            try:
                options = {"start_after": token} if token is not None else {}
                stream = await open_change_stream(
                    self._db, pipeline, max_await_time_ms=200, **options
                )
                async with stream:
                    if not self._opened.is_set():
                        # Read after the stream opened: nothing is missed, and an event
                        # the read already shows sets the same fields again.
                        doc = await self._db[LEASES].find_one({"_id": self._lease_name})
                        if doc is not None:
                            self._lease = dict(doc)
                            self._note_lease(set())
                        self._opened.set()
                    while True:
                        event = await stream.try_next()
                        if event is not None:
                            self._on_event(event)
                        token = stream.resume_token
            except PyMongoError:
                # The driver resumes what it can itself; past that (an election on a
                # busy server), the stream is opened again after the last event read.
                await asyncio.sleep(0.2)

    def _on_event(self, event: dict[str, Any]) -> None:
        coll = event.get("ns", {}).get("coll")
        key = (event.get("documentKey") or {}).get("_id")
        operation = event.get("operationType")
        if coll == MARKS and key in self._marks:
            self._marks[key].set()
        elif coll == LEASES and key == self._lease_name:
            if operation in ("insert", "replace"):
                self._lease = dict(event.get("fullDocument") or {})
                self._note_lease(set(self._lease))
            elif operation == "update":
                description = event.get("updateDescription") or {}
                updated = description.get("updatedFields") or {}
                self._lease.update(updated)
                for name in description.get("removedFields") or []:
                    self._lease.pop(name, None)
                self._note_lease(set(updated))
        elif coll == FIRES:
            at = as_utc(event.get("wallTime"))
            if not isinstance(at, dt.datetime):
                return
            if operation == "insert":
                term = (event.get("fullDocument") or {}).get("term")
            elif operation == "update":
                term = ((event.get("updateDescription") or {}).get("updatedFields") or {}).get(
                    "term"
                )
            else:
                term = None
            if isinstance(term, int):
                self.acts.append(Act(term, at, str(key)))

    def _note_lease(self, changed: set[str]) -> None:
        doc = self._lease
        term, acquired, renewed = (
            doc.get("term"),
            as_utc(doc.get("acquired_at")),
            as_utc(doc.get("renewed_at")),
        )
        if not (
            isinstance(term, int)
            and isinstance(acquired, dt.datetime)
            and isinstance(renewed, dt.datetime)
        ):
            return
        record = self.terms.get(term)
        if record is None:
            record = self.terms[term] = TermRecord(term, doc.get("holder"), acquired, renewed)
        if "renewed_at" in changed and renewed > record.last_renewed_at:
            record.last_renewed_at = renewed
            record.renewals += 1
        released = as_utc(doc.get("released_at"))
        if "released_at" in changed and isinstance(released, dt.datetime):
            record.released_at = released
