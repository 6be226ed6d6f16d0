"""Inserting many documents, or upserting, at once where a unique index may refuse some:
the one place that reads a bulk write's errors."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from pymongo.errors import BulkWriteError

from hascheduler.core.constants import DUPLICATE_KEY
from hascheduler.storage.collection import Collection


async def insert_new(
    collection: Collection, documents: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Insert ``documents`` unordered, in one round trip; the write errors (each with the
    refused document's ``index`` and the unique index's ``keyPattern``) of those a unique
    index refused. Raises BulkWriteError for any other failure."""
    return await _duplicates(collection.insert_many(documents, ordered=False))


async def refused_upserts(collection: Collection, requests: list[Any]) -> set[int]:
    """Run the upserts unordered in one round trip; the indexes of those whose filter
    matched no document while one with its ``_id`` exists (the upsert then collided)."""
    if not requests:
        return set()
    return {
        int(e["index"]) for e in await _duplicates(collection.bulk_write(requests, ordered=False))
    }


async def _duplicates(write: Awaitable[Any]) -> list[dict[str, Any]]:
    try:
        await write
    except BulkWriteError as exc:
        errors: list[dict[str, Any]] = exc.details.get("writeErrors", [])
        if any(e.get("code") != DUPLICATE_KEY for e in errors):
            raise
        return errors
    return []
