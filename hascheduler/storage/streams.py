"""What a mirror reads of a collection (every document, then its change stream), and where
the two async drivers differ (PyMongo's async API awaits what Motor returns at once):
opening a change stream and running an aggregation."""

from __future__ import annotations

import inspect
from typing import Any


def read_all(collection: Any, projection: dict[str, Any] | None = None, batch_size: int = 0) -> Any:
    """A cursor over every document of ``collection``, whole or with ``projection`` (an
    async iterable; ``batch_size`` 0: the driver's)."""
    return collection.find({}, projection, batch_size=batch_size)


async def open_change_stream(
    collection: Any, pipeline: list[dict[str, Any]] | None = None, **options: Any
) -> Any:
    """A change stream on ``collection``: PyMongo's async API opens it when awaited,
    Motor lazily on first use."""
    stream = collection.watch(pipeline, **options)
    if inspect.isawaitable(stream):
        stream = await stream
    return stream


async def aggregate(collection: Any, pipeline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every document an aggregation returns (callers keep its output small)."""
    cursor = collection.aggregate(pipeline)
    if inspect.isawaitable(cursor):
        cursor = await cursor
    return [doc async for doc in cursor]
