"""The fire ledger: every read and write of the ``fires`` collection (invariants 4 and 5,
docs/ARCHITECTURE.md).

A fire's document is keyed by its fire id, ``<schedule_id>@<nominal UTC time>``; inserting
it is the claim (a duplicate key means another leader owns it). Its state moves
``claimed`` -> ``published`` | ``skipped`` | ``failed`` | ``buffered`` (waiting for its
schedule's open run to end, core/overlap.py) and ``buffered`` -> ``claimed`` again when it
may go. A fire run now (``<schedule_id>@manual-<instant>``) is inserted ``requested`` by
the API and moved to ``claimed`` by the leader. Nothing else moves a state.

The fence, stated once: a leader's writes to a fire match only a claim of its own term
(``_own``), so a deposed leader's late write changes nothing. Taking over another term's
claim (adoption) matches only claims of older terms, never a newer leader's.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from pymongo import ASCENDING, DESCENDING, UpdateMany
from pymongo.errors import BulkWriteError, DuplicateKeyError, OperationFailure

from hascheduler.core.catchup import SkippedRange
from hascheduler.core.claims import Claim
from hascheduler.core.constants import DUPLICATE_KEY
from hascheduler.core.instants import as_utc
from hascheduler.core.triggers import fire_id, iso_utc
from hascheduler.storage.bulk import insert_new
from hascheduler.storage.collection import Collection
from hascheduler.storage.streams import aggregate

CLAIMED = "claimed"
PUBLISHED = "published"
SKIPPED = "skipped"
FAILED = "failed"
BUFFERED = "buffered"
REQUESTED = "requested"
STATES = (REQUESTED, CLAIMED, BUFFERED, PUBLISHED, SKIPPED, FAILED)
NOTICE = "notice"  # an entry a webhook is to be told of (Notices)

Document = dict[str, Any]


def claim_record(
    claim: Claim,
    term: int,
    now: dt.datetime,
    next_attempt_at: dt.datetime,
    backfill: str | None = None,
) -> Document:
    """A claim as its ledger document: inserted, it is the claim (made by ``backfill``,
    when a backfill's)."""
    doc = {
        "_id": claim.fire_id,
        "schedule_id": claim.schedule_id,
        "nominal_at": claim.nominal_at,
        "due_at": claim.due_at,
        "term": term,
        "state": CLAIMED,
        "claimed_at": now,
        "recorded_at": now,
        "attempts": claim.attempts,
        "next_attempt_at": next_attempt_at,
    }
    if claim.tenant is not None:
        doc["tenant"] = claim.tenant
    if backfill is not None:
        doc["backfill"] = backfill
    return doc


def claim_of(doc: Document) -> Claim:
    """A claim read back from the ledger (a retry, an adoption, a fire run now)."""
    return Claim(
        doc["_id"],
        doc["schedule_id"],
        as_utc(doc["nominal_at"]),
        as_utc(doc["due_at"]),
        doc.get("tenant"),
        int(doc.get("attempts", 0)),
        doc.get("payload"),
        doc.get("overlap"),
        doc.get("manual") is True,
        doc["trace"] if isinstance(doc.get("trace"), str) else None,
        doc["priority"] if isinstance(doc.get("priority"), int) else None,
    )


async def _in_lists(cursor: Any, size: int) -> AsyncGenerator[list[Claim]]:
    """A cursor's claims in lists of ``size``, each as soon as the cursor has read it."""
    claims: list[Claim] = []
    async for doc in cursor:
        claims.append(claim_of(doc))
        if len(claims) == size:
            yield claims
            claims = []
    if claims:
        yield claims


def manual_fire_id(schedule_id: str, now: dt.datetime) -> str:
    return f"{schedule_id}@manual-{iso_utc(now)}"


def request_documents(
    schedule_id: str,
    now: dt.datetime,
    by: str,
    payload: dict[str, Any] | None,
    overlap: str | None,
    idempotency_key: str | None,
    tenants: list[str] | None = None,
    trace: str | None = None,
    priority: int | None = None,
) -> list[Document]:
    """A fire run now, as the API inserts it for the leader to claim and publish: one
    document, or for a fan-out one per tenant (``<fire id>/<tenant>``, as a fire of its
    trigger). The first carries the idempotency key."""
    fire = manual_fire_id(schedule_id, now)
    base: Document = {
        "schedule_id": schedule_id,
        "nominal_at": now,
        "due_at": now,
        "state": REQUESTED,
        "manual": True,
        "requested_by": by,
        "recorded_at": now,
        "attempts": 0,
    }
    if payload is not None:
        base["payload"] = payload
    if overlap is not None:
        base["overlap"] = overlap
    if priority is not None:
        base["priority"] = priority
    if trace is not None:  # the request's traceparent: the fire's publish continues it
        base["trace"] = trace
    docs = (
        [{"_id": fire, **base}]
        if tenants is None
        else [{"_id": f"{fire}/{tenant}", **base, "tenant": tenant} for tenant in tenants]
    )
    if idempotency_key is not None and docs:
        docs[0]["idempotency_key"] = f"{schedule_id}/{idempotency_key}"
    return docs


def requested_fire(doc: Document) -> str:
    """The id of the fire run now that ``doc`` belongs to (a fan-out's has one document
    per tenant)."""
    fire = str(doc["_id"])
    tenant = doc.get("tenant")
    return fire[: -len(tenant) - 1] if isinstance(tenant, str) else fire


def claim_document(
    schedule_id: str, nominal: dt.datetime, due: dt.datetime, term: int, now: dt.datetime
) -> Document:
    """The document of a plain fire's claim made at ``now``."""
    return claim_record(
        Claim(fire_id(schedule_id, nominal), schedule_id, nominal, due), term, now, now
    )


def skipped_range_document(
    schedule_id: str,
    skipped: SkippedRange,
    term: int,
    now: dt.datetime,
    backfill: str | None = None,
) -> Document:
    """What one catch-up skipped for one schedule, as one entry: its first nominal time
    (``nominal_at``, so the history sorts it in place), its last, their count and why
    (and the backfill whose times they were, if one's)."""
    doc: Document = {
        "_id": f"{fire_id(schedule_id, skipped.first)}..{iso_utc(skipped.last)}",
        "schedule_id": schedule_id,
        "nominal_at": skipped.first,
        "last_nominal_at": skipped.last,
        "count": skipped.count,
        "term": term,
        "state": SKIPPED,
        "reason": skipped.reason,
        "recorded_at": now,
    }
    if backfill is not None:
        doc["backfill"] = backfill
    return doc


async def state_counts(
    collection: Any, schedule_id: str, nominals: list[dt.datetime]
) -> dict[dt.datetime, dict[str, int]]:
    """How many of a schedule's documents (fires or runs) at each of ``nominals`` are in
    each state, counted by the server (a fan-out fire has one per tenant)."""
    counts: dict[dt.datetime, dict[str, int]] = {as_utc(n): {} for n in nominals}
    for doc in await aggregate(
        collection,
        [
            {"$match": {"schedule_id": schedule_id, "nominal_at": {"$in": nominals}}},
            {
                "$group": {
                    "_id": {"nominal": "$nominal_at", "state": "$state"},
                    "count": {"$sum": 1},
                }
            },
        ],
    ):
        key = doc["_id"]
        counts.setdefault(as_utc(key["nominal"]), {})[str(key["state"])] = int(doc["count"])
    return counts


def _own(term: int, fire_ids: Iterable[str]) -> Document:
    """The fence: this term's claims among ``fire_ids``, still claimed."""
    return {"_id": {"$in": sorted(fire_ids)}, "term": term, "state": CLAIMED}


def _stale(fire_ids: Iterable[str], term: int) -> Document:
    """Claims among ``fire_ids`` left unpublished by ``term`` or an older term."""
    return {"_id": {"$in": sorted(fire_ids)}, "state": CLAIMED, "term": {"$lte": term}}


class Notices:
    """The states (skipped, failed) a webhook is to be told of now: the leader's write of
    such a state marks the entry (NOTICE) in that same write, until the leader's webhook
    work has made its deliveries (replica/webhooks.py). None wanted: no mark, no cost."""

    def __init__(self) -> None:
        self.wanted: frozenset[str] = frozenset()


class Ledger:
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
            _stale(fire_ids, term), {"$set": {"term": term, "claimed_at": now}}
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
                _own(term, fire_ids),
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
                [UpdateMany(_own(term, ids), update) for update, ids in updates], ordered=False
            )

    async def buffered_counts(self, schedule_ids: list[str]) -> dict[tuple[str, str | None], int]:
        """How many fires wait for each run key (schedule, tenant) of these schedules."""
        counts: dict[tuple[str, str | None], int] = {}
        async for d in self.fires.find(
            {"state": BUFFERED, "schedule_id": {"$in": sorted(schedule_ids)}},
            {"schedule_id": 1, "tenant": 1},
        ):
            key = (d["schedule_id"], d.get("tenant"))
            counts[key] = counts.get(key, 0) + 1
        return counts

    async def buffered_keys(self) -> set[tuple[str, str | None]]:
        """The run keys (schedule, tenant) with fires waiting."""
        return {
            (d["_id"]["s"], d["_id"].get("t"))
            for d in await aggregate(
                self.fires,
                [
                    {"$match": {"state": BUFFERED}},
                    {"$group": {"_id": {"s": "$schedule_id", "t": "$tenant"}}},
                ],
            )
        }

    async def first_buffered(
        self, keys: list[tuple[str, str | None]]
    ) -> dict[tuple[str, str | None], str]:
        """The earliest waiting fire of each of ``keys`` that has one."""
        wanted = set(keys)
        firsts: dict[tuple[str, str | None], str] = {}
        for d in await aggregate(
            self.fires,
            [
                {
                    "$match": {
                        "state": BUFFERED,
                        "schedule_id": {"$in": sorted({k[0] for k in keys})},
                    }
                },
                {"$sort": {"nominal_at": 1, "_id": 1}},
                {
                    "$group": {
                        "_id": {"s": "$schedule_id", "t": "$tenant"},
                        "fire": {"$first": "$_id"},
                    }
                },
            ],
        ):
            key = (d["_id"]["s"], d["_id"].get("t"))
            if key in wanted:
                firsts[key] = d["fire"]
        return firsts

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
        return [claim_of(d) async for d in self.fires.find(_own(term, fire_ids))]

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
                _own(term, fire_ids),
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
            _own(term, [fire_id_]),
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
            _own(term, [fire_id_]),
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

    async def backfilled(self, schedule_id: str, nominals: list[dt.datetime]) -> list[Document]:
        """The entries of a schedule's fires at ``nominals`` (not those run now), as a
        backfill's chunk counts them (core/backfill.py)."""
        return [
            d
            async for d in self.fires.find(
                {
                    "schedule_id": schedule_id,
                    "nominal_at": {"$in": nominals},
                    "manual": {"$ne": True},
                },
                {"nominal_at": 1, "state": 1, "reason": 1, "backfill": 1, "count": 1},
            )
        ]

    async def instants_held(
        self, schedule_id: str, nominals: list[dt.datetime]
    ) -> set[dt.datetime]:
        """Those of a schedule's ``nominals`` the ledger holds any entry at (a claim, a
        tenant's, a record), runs now aside."""
        return {
            as_utc(d["nominal_at"])
            async for d in self.fires.find(
                {
                    "schedule_id": schedule_id,
                    "nominal_at": {"$in": nominals},
                    "manual": {"$ne": True},
                },
                {"nominal_at": 1},
            )
        }

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

    # -- reads ----------------------------------------------------------------------------

    async def due_for_retry(
        self, term: int, now: dt.datetime, limit: int, batch: int
    ) -> AsyncGenerator[list[Claim]]:
        """This term's claims due for a (re)publish by ``now``, at most ``limit``, in lists
        of ``batch`` as one cursor reads them. One cursor: a query per list would return
        the claims of the lists before it until their marks are written."""
        async for claims in _in_lists(
            self.fires.find({"state": CLAIMED, "term": term, "next_attempt_at": {"$lte": now}})
            .limit(limit)
            .batch_size(batch),
            batch,
        ):
            yield claims

    async def left_due(
        self, term: int, now: dt.datetime, limit: int, batch: int
    ) -> AsyncGenerator[list[Claim]]:
        """The claims older terms left unpublished (or this term's previous lead: it stopped
        firing and led again), made and due by ``now``, latest due first, at most
        ``limit`` (a bounded sort: an hour's backlog would be millions), in lists of
        ``batch`` as one cursor reads them: a new lead's to adopt (``adopt``) and
        republish."""
        async for claims in _in_lists(
            self.fires.find(
                {
                    "state": CLAIMED,
                    "term": {"$lte": term},
                    "claimed_at": {"$lte": now},
                    "due_at": {"$lte": now},
                }
            )
            .sort([("due_at", DESCENDING), ("_id", ASCENDING)])
            .limit(limit)
            .batch_size(batch),
            batch,
        ):
            yield claims

    async def get(self, fire_id_: str) -> Document | None:
        doc: Document | None = await self.fires.find_one({"_id": fire_id_})
        return doc

    async def history(self, schedule_id: str, limit: int) -> list[Document]:
        """A schedule's ledger entries, latest nominal time first."""
        return [
            d
            async for d in self.fires.find({"schedule_id": schedule_id})
            .sort("nominal_at", -1)
            .limit(limit)
        ]

    async def last_of_trigger(self, schedule_id: str) -> Document | None:
        """The schedule's entry of latest nominal time among its trigger's fires (runs now
        and their requests left out)."""
        async for doc in (
            self.fires.find(
                {"schedule_id": schedule_id, "manual": {"$ne": True}}, {"payload": 0, "event": 0}
            )
            .sort("nominal_at", -1)
            .limit(1)
        ):
            found: Document = doc
            return found
        return None

    async def fire_times(self, schedule_id: str, limit: int) -> list[dt.datetime]:
        """A schedule's latest ``limit`` distinct nominal times, latest first. A fan-out
        fire has an entry per tenant at one nominal time, so this steps past each time
        found (one indexed query per step) rather than reading all its entries."""
        times: list[dt.datetime] = []
        query: Document = {"schedule_id": schedule_id}
        while len(times) < limit:
            docs = [
                d
                async for d in self.fires.find(query, {"nominal_at": 1})
                .sort("nominal_at", -1)
                .limit(limit - len(times))
            ]
            if not docs:
                break
            for doc in docs:
                if not times or doc["nominal_at"] != times[-1]:
                    times.append(doc["nominal_at"])
            query = {"schedule_id": schedule_id, "nominal_at": {"$lt": times[-1]}}
        return times[:limit]

    async def counts(
        self, schedule_id: str, nominals: list[dt.datetime]
    ) -> dict[dt.datetime, dict[str, int]]:
        return await state_counts(self.fires, schedule_id, nominals)

    async def window(self, schedule_id: str, since: dt.datetime, limit: int) -> list[Document]:
        """A schedule's entries of nominal time ``since`` or later, the latest ``limit``
        (the schedule_history index), latest first."""
        return [
            d
            async for d in self.fires.find(
                {"schedule_id": schedule_id, "nominal_at": {"$gte": since}},
                {
                    "state": 1,
                    "nominal_at": 1,
                    "due_at": 1,
                    "published_at": 1,
                    "tenant": 1,
                    "reason": 1,
                    "manual": 1,
                },
            )
            .sort("nominal_at", -1)
            .limit(limit)
        ]

    async def recent(self, since: dt.datetime, limit: int) -> list[Document]:
        """Entries recorded since ``since``, newest first: by recorded_at, the indexed field,
        so MongoDB walks the index backwards and stops at the limit however busy it is."""
        return [
            d
            async for d in self.fires.find({"recorded_at": {"$gte": since}})
            .sort("recorded_at", -1)
            .limit(limit)
        ]
