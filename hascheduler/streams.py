"""Opening a change stream with either async driver (the mirror and the elector use it)."""

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
