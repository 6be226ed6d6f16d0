"""The fire ledger: every read and write of the ``fires`` collection (invariants 4 and 5,
docs/ARCHITECTURE.md).

A fire's document is keyed by its fire id, ``<schedule_id>@<nominal UTC time>``; inserting
it is the claim (a duplicate key means another leader owns it). Its state moves
``claimed`` -> ``published`` | ``skipped`` | ``failed``, and nothing else moves it.

The fence, stated once: a leader's writes to a fire match only a claim of its own term
(``_own``), so a deposed leader's late write changes nothing. Taking over another term's
claim (adoption) matches only claims of older terms, never a newer leader's.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterable
from typing import Any, Protocol

from pymongo import ASCENDING, DESCENDING
from pymongo.errors import BulkWriteError, DuplicateKeyError, OperationFailure

from hascheduler.core.catchup import SkippedRange
from hascheduler.core.claims import Claim
from hascheduler.core.instants import as_utc
from hascheduler.core.triggers import fire_id, iso_utc
from hascheduler.storage.streams import aggregate

CLAIMED = "claimed"
PUBLISHED = "published"
SKIPPED = "skipped"
FAILED = "failed"
STATES = (CLAIMED, PUBLISHED, SKIPPED, FAILED)

Document = dict[str, Any]


def claim_record(claim: Claim, term: int, now: dt.datetime,
                 next_attempt_at: dt.datetime) -> Document:
    """A claim as its ledger document: inserted, it is the claim."""
    doc = {"_id": claim.fire_id, "schedule_id": claim.schedule_id,
           "nominal_at": claim.nominal_at, "due_at": claim.due_at, "term": term,
           "state": CLAIMED, "claimed_at": now, "recorded_at": now, "attempts": claim.attempts,
           "next_attempt_at": next_attempt_at}
    if claim.tenant is not None:
        doc["tenant"] = claim.tenant
    return doc


def claim_of(doc: Document) -> Claim:
    """A claim read back from the ledger (a retry, an adoption)."""
    return Claim(doc["_id"], doc["schedule_id"], as_utc(doc["nominal_at"]),
                 as_utc(doc["due_at"]), doc.get("tenant"), int(doc.get("attempts", 0)))


def claim_document(schedule_id: str, nominal: dt.datetime, due: dt.datetime, term: int,
                   now: dt.datetime) -> Document:
    """The document of a plain fire's claim made at ``now``."""
    return claim_record(Claim(fire_id(schedule_id, nominal), schedule_id, nominal, due), term,
                        now, now)


def skipped_range_document(schedule_id: str, skipped: SkippedRange, term: int,
                           now: dt.datetime) -> Document:
    """What one catch-up skipped for one schedule, as one entry: its first nominal time
    (``nominal_at``, so the history sorts it in place), its last, their count and why."""
    return {"_id": f"{fire_id(schedule_id, skipped.first)}..{iso_utc(skipped.last)}",
            "schedule_id": schedule_id, "nominal_at": skipped.first,
            "last_nominal_at": skipped.last, "count": skipped.count, "term": term,
            "state": SKIPPED, "reason": skipped.reason, "recorded_at": now}


class FiresCollection(Protocol):
    """The slice of a driver collection the ledger uses (PyMongo async or Motor)."""

    async def insert_many(self, documents: Any, *args: Any, **kwargs: Any) -> Any: ...
    async def update_one(self, filter: Any, update: Any, *args: Any,
                         **kwargs: Any) -> Any: ...
    async def update_many(self, filter: Any, update: Any, *args: Any,
                          **kwargs: Any) -> Any: ...
    async def create_index(self, keys: Any, **kwargs: Any) -> Any: ...
    async def drop_index(self, index_or_name: Any, **kwargs: Any) -> Any: ...
    def find(self, *args: Any, **kwargs: Any) -> Any: ...
    def aggregate(self, pipeline: Any, *args: Any, **kwargs: Any) -> Any: ...


async def state_counts(collection: Any, schedule_id: str, nominals: list[dt.datetime]
                       ) -> dict[dt.datetime, dict[str, int]]:
    """How many of a schedule's documents (fires or runs) at each of ``nominals`` are in
    each state, counted by the server (a fan-out fire has one per tenant)."""
    counts: dict[dt.datetime, dict[str, int]] = {as_utc(n): {} for n in nominals}
    for doc in await aggregate(collection, [
            {"$match": {"schedule_id": schedule_id, "nominal_at": {"$in": nominals}}},
            {"$group": {"_id": {"nominal": "$nominal_at", "state": "$state"},
                        "count": {"$sum": 1}}}]):
        key = doc["_id"]
        counts.setdefault(as_utc(key["nominal"]), {})[str(key["state"])] = int(doc["count"])
    return counts


def _own(term: int, fire_ids: Iterable[str]) -> Document:
    """The fence: this term's claims among ``fire_ids``, still claimed."""
    return {"_id": {"$in": sorted(fire_ids)}, "term": term, "state": CLAIMED}


class Ledger:
    def __init__(self, fires: FiresCollection) -> None:
        self.fires = fires

    async def ensure_indexes(self, retention_s: float) -> None:
        # Claimed fires only (a partial index): the leader's retry and adoption scans look
        # for nothing else, and a fire leaves it once published instead of moving within it.
        await self.fires.create_index([("term", ASCENDING)], name="claimed_by_term",
                                      partialFilterExpression={"state": CLAIMED})
        with contextlib.suppress(OperationFailure):  # its predecessor, on (state, term)
            await self.fires.drop_index("state_term")
        await self.fires.create_index([("schedule_id", ASCENDING), ("nominal_at", DESCENDING)],
                                      name="schedule_history")
        await self.fires.create_index([("recorded_at", ASCENDING)], name="retention",
                                      expireAfterSeconds=int(retention_s))

    # -- a leader's writes ----------------------------------------------------------------

    async def claim(self, docs: list[Document]) -> set[str]:
        """Insert claims; the ids already in the ledger (claimed by someone: maybe us)."""
        try:
            await self.fires.insert_many(docs, ordered=False)
        except BulkWriteError as exc:
            errors = exc.details.get("writeErrors", [])
            if any(e.get("code") != 11000 for e in errors):
                raise
            return {docs[e["index"]]["_id"] for e in errors}
        return set()

    async def adopt(self, fire_ids: set[str], term: int, now: dt.datetime) -> set[str]:
        """Take over those of ``fire_ids`` still claimed by an older term (a deposed leader
        that claimed and never published); returns the ones taken."""
        if not fire_ids:
            return set()
        stale = {"_id": {"$in": sorted(fire_ids)}, "state": CLAIMED, "term": {"$lt": term}}
        found = {d["_id"] async for d in self.fires.find(stale, {"_id": 1})}
        if found:
            await self.fires.update_many({**stale, "_id": {"$in": sorted(found)}},
                                         {"$set": {"term": term, "claimed_at": now}})
        return found

    async def adopt_due(self, term: int, now: dt.datetime, claimed_before: dt.datetime) -> int:
        """Take over every older term's claim made before ``claimed_before`` whose due time
        has come (one made ahead waits for it), to be republished now; how many."""
        result = await self.fires.update_many(
            {"state": CLAIMED, "term": {"$lt": term}, "claimed_at": {"$lte": claimed_before},
             "due_at": {"$lte": now}},
            {"$set": {"term": term, "next_attempt_at": now}})
        return int(result.modified_count)

    async def skip(self, fire_ids: list[str], term: int, reason: str) -> None:
        if fire_ids:
            await self.fires.update_many(_own(term, fire_ids),
                                         {"$set": {"state": SKIPPED, "reason": reason}})

    async def mark_published(self, fire_ids: list[str], term: int, at: dt.datetime,
                             attempt: int) -> None:
        await self.fires.update_many(
            _own(term, fire_ids),
            {"$set": {"state": PUBLISHED, "published_at": at, "attempts": attempt},
             "$unset": {"next_attempt_at": ""}})

    async def mark_failed(self, fire_id_: str, term: int, attempt: int, error: str,
                          at: dt.datetime) -> None:
        await self.fires.update_one(_own(term, [fire_id_]), {"$set": {
            "state": FAILED, "attempts": attempt, "last_error": error, "failed_at": at}})

    async def retry_later(self, fire_id_: str, term: int, attempt: int, error: str,
                          at: dt.datetime) -> None:
        await self.fires.update_one(_own(term, [fire_id_]), {"$set": {
            "attempts": attempt, "last_error": error, "next_attempt_at": at}})

    async def record_skipped(self, docs: list[Document]) -> None:
        """Insert skipped-range entries; one already recorded (the same range planned by an
        earlier takeover) stays as it is."""
        if docs:
            with contextlib.suppress(BulkWriteError, DuplicateKeyError):
                await self.fires.insert_many(docs, ordered=False)

    # -- reads ----------------------------------------------------------------------------

    async def due_for_retry(self, term: int, now: dt.datetime, limit: int) -> list[Claim]:
        return [claim_of(d) async for d in self.fires.find(
            {"state": CLAIMED, "term": term, "next_attempt_at": {"$lte": now}}).limit(limit)]

    async def history(self, schedule_id: str, limit: int) -> list[Document]:
        """A schedule's ledger entries, latest nominal time first."""
        return [d async for d in self.fires.find({"schedule_id": schedule_id}).sort(
            "nominal_at", -1).limit(limit)]

    async def fire_times(self, schedule_id: str, limit: int) -> list[dt.datetime]:
        """A schedule's latest ``limit`` distinct nominal times, latest first. A fan-out
        fire has an entry per tenant at one nominal time, so this steps past each time
        found (one indexed query per step) rather than reading all its entries."""
        times: list[dt.datetime] = []
        query: Document = {"schedule_id": schedule_id}
        while len(times) < limit:
            docs = [d async for d in self.fires.find(query, {"nominal_at": 1}).sort(
                "nominal_at", -1).limit(limit - len(times))]
            if not docs:
                break
            for doc in docs:
                if not times or doc["nominal_at"] != times[-1]:
                    times.append(doc["nominal_at"])
            query = {"schedule_id": schedule_id, "nominal_at": {"$lt": times[-1]}}
        return times[:limit]

    async def counts(self, schedule_id: str, nominals: list[dt.datetime]
                     ) -> dict[dt.datetime, dict[str, int]]:
        return await state_counts(self.fires, schedule_id, nominals)

    async def recent(self, since: dt.datetime, limit: int) -> list[Document]:
        """Entries recorded since ``since``, newest first: by recorded_at, the indexed field,
        so MongoDB walks the index backwards and stops at the limit however busy it is."""
        return [d async for d in self.fires.find({"recorded_at": {"$gte": since}}).sort(
            "recorded_at", -1).limit(limit)]
