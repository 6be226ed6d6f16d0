"""Lists newest first, a page at a time: the one place a page's anchor becomes a query."""

from __future__ import annotations

from typing import Any

from hascheduler.storage.collection import Collection


async def older_than(collection: Collection, field: str, anchor_id: str) -> dict[str, Any]:
    """The condition for the documents after ``anchor_id`` in (``field``, ``_id``)
    descending order: the next page's. Raises LookupError when it names no document
    (expired since, or never there)."""
    anchor = await collection.find_one({"_id": anchor_id}, {field: 1})
    if anchor is None:
        raise LookupError(anchor_id)
    return {
        "$or": [{field: {"$lt": anchor[field]}}, {field: anchor[field], "_id": {"$lt": anchor_id}}]
    }
