"""Inserting many documents at once where a unique index may refuse some: the one place
that reads a bulk write's errors."""

from __future__ import annotations

from typing import Any, Protocol

from pymongo.errors import BulkWriteError

from hascheduler.core.constants import DUPLICATE_KEY


class Inserts(Protocol):
    async def insert_many(self, documents: Any, *args: Any, **kwargs: Any) -> Any: ...


async def insert_new(collection: Inserts, documents: list[dict[str, Any]]
                     ) -> list[dict[str, Any]]:
    """Insert ``documents`` unordered, in one round trip; the write errors (each with the
    refused document's ``index`` and the unique index's ``keyPattern``) of those a unique
    index refused. Raises BulkWriteError for any other failure."""
    try:
        await collection.insert_many(documents, ordered=False)
    except BulkWriteError as exc:
        errors: list[dict[str, Any]] = exc.details.get("writeErrors", [])
        if any(e.get("code") != DUPLICATE_KEY for e in errors):
            raise
        return errors
    return []
