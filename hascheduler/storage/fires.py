"""The fire ledger: every read and write of the ``fires`` collection (invariants 4 and 5,
docs/ARCHITECTURE.md).

A fire's document is keyed by its fire id, ``<schedule_id>@<nominal UTC time>``; inserting
it is the claim (a duplicate key means another leader owns it). Its state moves
``claimed`` -> ``published`` | ``skipped`` | ``failed`` | ``buffered`` (waiting for its
schedule's open run to end, core/overlap.py) and ``buffered`` -> ``claimed`` again when it
may go. A fire run now (``<schedule_id>@manual-<instant>``) is inserted ``requested`` by
the API and moved to ``claimed`` by the leader. Nothing else moves a state.

The fence, stated once: a leader's writes to a fire match only a claim of its own term
(``own``, storage/fire_records.py), so a deposed leader's late write changes nothing.
Taking over another term's claim (adoption) matches only claims of older terms, never a
newer leader's.
"""

from __future__ import annotations

import contextlib
import datetime as dt

from pymongo import ASCENDING, DESCENDING, UpdateMany
from pymongo.errors import BulkWriteError, DuplicateKeyError, OperationFailure

from hascheduler.core.claims import Claim
from hascheduler.core.constants import DUPLICATE_KEY
from hascheduler.storage.bulk import insert_new
from hascheduler.storage.collection import Collection
from hascheduler.storage.fire_reads import FireReads
from hascheduler.storage.fire_records import (
    BUFFERED,
    CLAIMED,
    FAILED,
    NOTICE,
    PUBLISHED,
    REQUESTED,
    SKIPPED,
    Document,
    claim_of,
    own,
    stale,
)


class Notices:
    """The states (skipped, failed) a webhook is to be told of now: the leader's write of
    such a state marks the entry (NOTICE) in that same write, until the leader's webhook
    work has made its deliveries (replica/webhooks.py). None wanted: no mark, no cost."""

    def __init__(self) -> None:
        self.wanted: frozenset[str] = frozenset()


class Ledger(FireReads):
    """The fire ledger: the API's and a leader's writes here; the reads are a room of
    their own (storage/fire_reads.py)."""

    def __init__(self, fires: Collection, notices: Notices | None = None) -> None:
        self.fires = fires
        self.notices = notices or Notices()

    def _marked(self, sets: Document, state: str) -> Document:
        return {**sets, NOTICE: True} if state in self.notices.wanted else sets

    async def ensure_indexes(self, retention_s: float) -> None:
        # Claimed fires only (a partial index): the leader's retry and adoption scans look
        # for nothing else, and a fire leaves it once published instead of moving within it.
        await self.fires.create_index(
            [("term", ASCENDING)],
            name="claimed_by_term",
            partialFilterExpression={"state": CLAIMED},
        )
        # The retry scan's range: at 10,000 fires a second some 15,000 claims wait for
        # their due time, and reading them all every half second to find the few whose
        # publish timed out cost the database a third of a core.
        await self.fires.create_index(
            [("next_attempt_at", ASCENDING)],
            name="retry_due",
            partialFilterExpression={"state": CLAIMED},
        )
        await self.fires.create_index(
            [(NOTICE, ASCENDING)],
            name="noticed",
            partialFilterExpression={NOTICE: {"$exists": True}},
        )
        with contextlib.suppress(OperationFailure):  # its predecessor, on (state, term)
            await self.fires.drop_index("state_term")
        await self.fires.create_index(
            [("schedule_id", ASCENDING), ("nominal_at", DESCENDING)], name="schedule_history"
        )
        await self.fires.create_index(
            [("recorded_at", ASCENDING)], name="retention", expireAfterSeconds=int(retention_s)
        )
        await self.fires.create_index(
            [("schedule_id", ASCENDING), ("nominal_at", ASCENDING)],
            name="buffered",
            partialFilterExpression={"state": BUFFERED},
        )
        await self.fires.create_index(
            [("nominal_at", ASCENDING)],
            name="requested",
            partialFilterExpression={"state": REQUESTED},
        )
        # Kept as long as the fire (the retention period, 7 days by default: over the 24 h
        # an idempotency key is promised for).
        await self.fires.create_index(
            [("idempotency_key", ASCENDING)],
            name="idempotency",
            unique=True,
            partialFilterExpression={"idempotency_key": {"$exists": True}},
        )

    # -- the API's writes -----------------------------------------------------------------

    async def request(self, docs: list[Document]) -> tuple[Document, bool]:
        """Insert a fire run now (request_documents); (its first document, True), or
        (the first document of the earlier fire made with the same idempotency key,
        False). In order: a key already used stops the insert at the first document."""
        try:
            await self.fires.insert_many(docs, ordered=True)
            return docs[0], True
        except BulkWriteError as exc:
            errors = exc.details.get("writeErrors", [])
            key = docs[0].get("idempotency_key")
            on_first = (
                bool(errors)
                and errors[0].get("index") == 0
                and errors[0].get("code") == DUPLICATE_KEY
            )
            first = await self.requested_with_key(key) if key is not None and on_first else None
            if first is None:  # not the key (the same instant twice: the fire id)
                raise
            return first, False

    async def requested_with_key(self, key: str) -> Document | None:
        """The first document of the fire run now with this idempotency key, if any."""
        doc: Document | None = await self.fires.find_one({"idempotency_key": key})
        return doc

    async def withdraw(self, fire_id_: str, reason: str) -> bool:
        """A fire still waiting (buffered, or requested and not yet claimed) is not to be
        published: recorded skipped, saying why. Whether it was still waiting."""
        result = await self.fires.update_one(
            {"_id": fire_id_, "state": {"$in": [BUFFERED, REQUESTED]}},
            {"$set": {"state": SKIPPED, "reason": reason}},
        )
        return bool(result.matched_count)

    # -- a leader's writes ----------------------------------------------------------------

    async def claimed(self, fire_ids: list[str]) -> set[str]:
        """Those of ``fire_ids`` in the ledger (claimed by someone: maybe us). Read before
        claiming when many are likely there: an insert the unique index refuses costs the
        database several times the read (docs/BENCHMARKS.md, Development MongoDB
        server)."""
        return {d["_id"] async for d in self.fires.find({"_id": {"$in": fire_ids}}, {"_id": 1})}

    async def claim(self, docs: list[Document]) -> set[str]:
        """Insert claims; the ids already in the ledger (claimed by someone: maybe us)."""
        if not docs:
            return set()
        return {docs[e["index"]]["_id"] for e in await insert_new(self.fires, docs)}

    async def adopt(self, fire_ids: set[str], term: int, now: dt.datetime) -> set[str]:
        """Take over those of ``fire_ids`` still claimed and unpublished by an older term (a
        deposed leader) or by this term before it stopped firing and led again (its
        in-flight publishes went with it); the ids taken. The caller passes only claims its
        own pending publishes do not hold. One write when it takes them all (the claims
        were found left so); else a read says which it took (one published or taken by a
        newer term since is left alone)."""
        if not fire_ids:
            return set()
        result = await self.fires.update_many(
            stale(fire_ids, term), {"$set": {"term": term, "claimed_at": now}}
        )
        if result.matched_count == len(fire_ids):
            return set(fire_ids)
        return {
            d["_id"]
            async for d in self.fires.find(
                {
                    "_id": {"$in": sorted(fire_ids)},
                    "state": CLAIMED,
                    "term": term,
                    "claimed_at": now,
                },
                {"_id": 1},
            )
        }

    async def adopt_due(self, term: int, now: dt.datetime, claimed_before: dt.datetime) -> int:
        """Take over every older term's claim made before ``claimed_before`` whose due time
        has come (one made ahead waits for it), to be republished now; how many."""
        result = await self.fires.update_many(
            {
                "state": CLAIMED,
                "term": {"$lt": term},
                "claimed_at": {"$lte": claimed_before},
                "due_at": {"$lte": now},
            },
            {"$set": {"term": term, "next_attempt_at": now}},
        )
        return int(result.modified_count)

    async def skip(self, fire_ids: list[str], term: int, reason: str) -> None:
        if fire_ids:
            await self.fires.update_many(
                own(term, fire_ids),
                {"$set": self._marked({"state": SKIPPED, "reason": reason}, SKIPPED)},
            )

    async def skip_overlapping(self, skipped: dict[str, tuple[str, str]], term: int) -> None:
        """Record fires skipped by their overlap policy: fire id -> (reason, the open run's
        fire id)."""
        groups: dict[tuple[str, str], list[str]] = {}
        for fire, why in skipped.items():
            groups.setdefault(why, []).append(fire)
        await self._update_groups(
            term,
            [
                (
                    {
                        "$set": self._marked(
                            {"state": SKIPPED, "reason": reason, "open_run": blocker}, SKIPPED
                        )
                    },
                    ids,
                )
                for (reason, blocker), ids in groups.items()
            ],
        )

    async def buffer(self, waiting: dict[str, str], term: int, now: dt.datetime) -> None:
        """Fires that wait for their schedule's open run (fire id -> its fire id)."""
        groups: dict[str, list[str]] = {}
        for fire, blocker in waiting.items():
            groups.setdefault(blocker, []).append(fire)
        await self._update_groups(
            term,
            [
                (
                    {
                        "$set": {"state": BUFFERED, "open_run": blocker, "buffered_at": now},
                        "$unset": {"next_attempt_at": ""},
                    },
                    ids,
                )
                for blocker, ids in groups.items()
            ],
        )

    async def _update_groups(self, term: int, updates: list[tuple[Document, list[str]]]) -> None:
        """Each group of this term's claims updated its own way, all in one round trip (a
        group per open run: thousands at a busy second)."""
        if updates:
            await self.fires.bulk_write(
                [UpdateMany(own(term, ids), update) for update, ids in updates], ordered=False
            )

    async def take(
        self, fire_ids: list[str], state: str, term: int, now: dt.datetime, retry_at: dt.datetime
    ) -> None:
        """Claim for ``term`` those of ``fire_ids`` still in ``state`` (buffered fires
        whose wait is over, fires requested by the API), to publish now (``taken`` reads
        which)."""
        if fire_ids:
            await self.fires.update_many(
                {"_id": {"$in": sorted(fire_ids)}, "state": state},
                {
                    "$set": {
                        "state": CLAIMED,
                        "term": term,
                        "claimed_at": now,
                        "next_attempt_at": retry_at,
                    }
                },
            )

    async def taken(self, fire_ids: list[str], term: int) -> list[Claim]:
        """Those of ``fire_ids`` claimed and unpublished by ``term``."""
        if not fire_ids:
            return []
        return [claim_of(d) async for d in self.fires.find(own(term, fire_ids))]

    async def undone(self, fire_ids: list[str]) -> set[str]:
        """Those of ``fire_ids`` recorded skipped or failed, or buffered: not published,
        and not to be published on a run reserved for them before."""
        if not fire_ids:
            return set()
        return {
            d["_id"]
            async for d in self.fires.find(
                {"_id": {"$in": sorted(fire_ids)}, "state": {"$in": [SKIPPED, FAILED, BUFFERED]}},
                {"_id": 1},
            )
        }

    async def requested(self, limit: int) -> list[str]:
        """Fires the API asked to run now, oldest request first."""
        return [
            d["_id"]
            async for d in self.fires.find({"state": REQUESTED}, {"_id": 1})
            .sort("nominal_at", ASCENDING)
            .limit(limit)
        ]

    async def mark_published(
        self, fire_ids: list[str], term: int, at: dt.datetime, attempt: int
    ) -> None:
        await self.mark_published_many([(fire_ids, term, at, attempt)])

    async def mark_published_many(
        self, marks: list[tuple[list[str], int, dt.datetime, int]]
    ) -> None:
        """Several publishes' marks (fire ids, term, acknowledged at, attempt) in one round
        trip, a statement each."""
        updates = [
            UpdateMany(
                own(term, fire_ids),
                {
                    "$set": {"state": PUBLISHED, "published_at": at, "attempts": attempt},
                    "$unset": {"next_attempt_at": ""},
                },
            )
            for fire_ids, term, at, attempt in marks
            if fire_ids
        ]
        if updates:
            await self.fires.bulk_write(updates, ordered=False)

    async def mark_failed(
        self, fire_id_: str, term: int, attempt: int, error: str, at: dt.datetime
    ) -> None:
        await self.fires.update_one(
            own(term, [fire_id_]),
            {
                "$set": self._marked(
                    {"state": FAILED, "attempts": attempt, "last_error": error, "failed_at": at},
                    FAILED,
                )
            },
        )

    async def retry_later(
        self, fire_id_: str, term: int, attempt: int, error: str, at: dt.datetime
    ) -> None:
        await self.fires.update_one(
            own(term, [fire_id_]),
            {"$set": {"attempts": attempt, "last_error": error, "next_attempt_at": at}},
        )

    async def record_skipped(self, docs: list[Document]) -> None:
        """Insert skipped-range entries; one already recorded (the same range planned by an
        earlier takeover) stays as it is."""
        if docs:
            with contextlib.suppress(BulkWriteError, DuplicateKeyError):
                await self.fires.insert_many(
                    [self._marked(d, SKIPPED) for d in docs], ordered=False
                )

    async def release(self, fire_ids: list[str], term: int, reason: str) -> None:
        """Free fires this term recorded skipped for ``reason`` (a backfill's, withdrawn by
        a pause): their times may be fired again."""
        if fire_ids:
            await self.fires.delete_many(
                {"_id": {"$in": sorted(fire_ids)}, "term": term, "state": SKIPPED, "reason": reason}
            )

    async def noticed_entries(self, limit: int) -> list[Document]:
        """Entries marked for the webhooks (skipped or failed), oldest marks first."""
        return [d async for d in self.fires.find({NOTICE: True}).limit(limit)]

    async def clear_notices(self, fire_ids: list[str]) -> None:
        if fire_ids:
            await self.fires.update_many(
                {"_id": {"$in": sorted(fire_ids)}}, {"$unset": {NOTICE: ""}}
            )
