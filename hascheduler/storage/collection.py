"""The one name for a driver collection of documents: PyMongo's async API (Motor's offers
the same calls)."""

from __future__ import annotations

from typing import Any

from pymongo.asynchronous.collection import AsyncCollection

Collection = AsyncCollection[dict[str, Any]]
