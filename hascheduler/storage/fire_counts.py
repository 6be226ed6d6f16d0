"""How many fires each schedule with ``max_fires`` has used: the ``fire_counts``
collection, one document per schedule holding the ids of the fires counted against it.

Counting a fire is one atomic update that adds its id only while fewer than the limit are
held (or finds it already there), so a fire published again after a failover is counted
once, and no fire beyond the limit is ever counted whatever the leaders do. ``n`` follows
the set in a second write (read without the ids); a crash between the two leaves it one
short, which shows in ``fires_remaining`` only: the limit is the set's.
"""

from __future__ import annotations

from typing import Any

from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError

from hascheduler.storage.collection import Collection

Document = dict[str, Any]


class FireCounts:
    def __init__(self, counts: Collection) -> None:
        self.counts = counts

    async def take(self, schedule_id: str, fire_id: str, limit: int) -> int | None:
        """Count ``fire_id`` against the schedule's ``limit``: how many are counted with
        it, or None when the limit was reached without it."""
        try:
            result = await self.counts.update_one(
                {
                    "_id": schedule_id,
                    "$or": [{"ids": fire_id}, {f"ids.{limit - 1}": {"$exists": False}}],
                },
                {"$addToSet": {"ids": fire_id}},
                upsert=True,
            )
        except DuplicateKeyError:  # the document exists and holds the limit without it
            return None
        if result.modified_count or result.upserted_id is not None:
            doc = await self.counts.find_one_and_update(
                {"_id": schedule_id},
                {"$inc": {"n": 1}},
                {"n": 1},
                return_document=ReturnDocument.AFTER,
            )
        else:  # counted before (published again)
            doc = await self.counts.find_one({"_id": schedule_id}, {"n": 1})
        return int(doc.get("n", 0)) if doc else 0

    async def release(self, schedule_id: str, fire_id: str) -> None:
        """A counted fire was never published (it failed): it no longer counts."""
        await self.counts.update_one(
            {"_id": schedule_id}, {"$pull": {"ids": fire_id}, "$inc": {"n": -1}}
        )

    async def used(self, schedule_id: str) -> int:
        doc = await self.counts.find_one({"_id": schedule_id}, {"n": 1})
        return int(doc.get("n", 0)) if doc else 0
