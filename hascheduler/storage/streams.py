"""Where the two async drivers differ (PyMongo's async API awaits what Motor returns at
once): opening a change stream and running an aggregation."""

from __future__ import annotations

import inspect
from typing import Any


async def open_change_stream(collection: Any, pipeline: list[dict[str, Any]] | None = None,
                             **options: Any) -> Any:
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
