"""The fire ledger's reads (storage/fires.py): a schedule's entries and counts, the
claims a leader republishes or adopts, buffered fires. A room of ``Ledger``."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncGenerator
from typing import Any

from pymongo import ASCENDING, DESCENDING

from hascheduler.core.claims import Claim
from hascheduler.core.instants import as_utc
from hascheduler.storage.collection import Collection
from hascheduler.storage.fire_records import BUFFERED, CLAIMED, Document, claim_of, of_schedule
from hascheduler.storage.streams import aggregate


async def state_counts(
    collection: Any, schedule_id: str, nominals: list[dt.datetime], namespace: str | None = None
) -> dict[dt.datetime, dict[str, int]]:
    """How many of a schedule's documents (fires or runs) at each of ``nominals`` are in
    each state, counted by the server (a fan-out fire has one per tenant)."""
    counts: dict[dt.datetime, dict[str, int]] = {as_utc(n): {} for n in nominals}
    for doc in await aggregate(
        collection,
        [
            {"$match": {**of_schedule(schedule_id, namespace), "nominal_at": {"$in": nominals}}},
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


async def in_lists(cursor: Any, size: int) -> AsyncGenerator[list[Claim]]:
    """A cursor's claims in lists of ``size``, each as soon as the cursor has read it."""
    claims: list[Claim] = []
    async for doc in cursor:
        claims.append(claim_of(doc))
        if len(claims) == size:
            yield claims
            claims = []
    if claims:
        yield claims


class FireReads:
    fires: Collection

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

    async def due_for_retry(
        self, term: int, now: dt.datetime, limit: int, batch: int
    ) -> AsyncGenerator[list[Claim]]:
        """This term's claims due for a (re)publish by ``now``, at most ``limit``, in lists
        of ``batch`` as one cursor reads them. One cursor: a query per list would return
        the claims of the lists before it until their marks are written."""
        async for claims in in_lists(
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
        async for claims in in_lists(
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

    async def namespace_of(self, fire: str) -> str | None:
        """The namespace kept with a fire's entry (or, for a fan-out fire, its tenants'
        entries: ids ``<fire>/<tenant>``); None for none, or one written before it was
        kept."""
        doc = await self.fires.find_one(
            {"_id": fire}, {"namespace": 1}
        ) or await self.fires.find_one(
            {"_id": {"$gt": f"{fire}/", "$lt": f"{fire}0"}}, {"namespace": 1}
        )
        kept = doc.get("namespace") if doc is not None else None
        return kept if isinstance(kept, str) else None

    async def get(self, fire_id_: str) -> Document | None:
        doc: Document | None = await self.fires.find_one({"_id": fire_id_})
        return doc

    async def history(
        self, schedule_id: str, limit: int, namespace: str | None = None
    ) -> list[Document]:
        """A schedule's ledger entries, latest nominal time first."""
        return [
            d
            async for d in self.fires.find(of_schedule(schedule_id, namespace))
            .sort("nominal_at", -1)
            .limit(limit)
        ]

    async def last_of_trigger(
        self, schedule_id: str, namespace: str | None = None
    ) -> Document | None:
        """The schedule's entry of latest nominal time among its trigger's fires (runs now
        and their requests left out)."""
        async for doc in (
            self.fires.find(
                {**of_schedule(schedule_id, namespace), "manual": {"$ne": True}},
                {"payload": 0, "event": 0},
            )
            .sort("nominal_at", -1)
            .limit(1)
        ):
            found: Document = doc
            return found
        return None

    async def fire_times(
        self, schedule_id: str, limit: int, namespace: str | None = None
    ) -> list[dt.datetime]:
        """A schedule's latest ``limit`` distinct nominal times, latest first. A fan-out
        fire has an entry per tenant at one nominal time, so this steps past each time
        found (one indexed query per step) rather than reading all its entries."""
        times: list[dt.datetime] = []
        query = of_schedule(schedule_id, namespace)
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
            query = {**of_schedule(schedule_id, namespace), "nominal_at": {"$lt": times[-1]}}
        return times[:limit]

    async def counts(
        self, schedule_id: str, nominals: list[dt.datetime], namespace: str | None = None
    ) -> dict[dt.datetime, dict[str, int]]:
        return await state_counts(self.fires, schedule_id, nominals, namespace)

    async def window(
        self, schedule_id: str, since: dt.datetime, limit: int, namespace: str | None = None
    ) -> list[Document]:
        """A schedule's entries of nominal time ``since`` or later, the latest ``limit``
        (the schedule_history index), latest first."""
        return [
            d
            async for d in self.fires.find(
                {**of_schedule(schedule_id, namespace), "nominal_at": {"$gte": since}},
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
