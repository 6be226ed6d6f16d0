"""Instants as the package keeps them: timezone-aware, in UTC.

BSON dates carry no zone, and a client created without ``tz_aware`` reads them naive: every
value read back from MongoDB passes through here once, so comparisons never mix the two.
"""

from __future__ import annotations

import datetime as dt
from typing import Any


def as_utc(value: Any) -> Any:
    """A naive datetime read as UTC; anything else (aware datetimes, None) as it is."""
    if isinstance(value, dt.datetime) and value.tzinfo is None:
        return value.replace(tzinfo=dt.UTC)
    return value


def as_utc_deep(value: Any) -> Any:
    """``as_utc`` through a document's nested dictionaries and lists."""
    if isinstance(value, dict):
        return {k: as_utc_deep(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_utc_deep(v) for v in value]
    return as_utc(value)
