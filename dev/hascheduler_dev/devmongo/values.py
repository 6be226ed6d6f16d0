"""BSON value ordering and hashing, as MongoDB's indexes see values.

MongoDB compares values of different BSON types by a fixed type order (numbers of every
width compare as numbers, booleans are never numbers), so index keys carry the type's rank
in front of the value. Python alone would make ``True == 1`` and refuse ``1 < "a"``.
"""

from __future__ import annotations

import datetime
import re
import uuid
from collections.abc import Hashable, Mapping, Sequence
from decimal import Decimal
from typing import Any, ClassVar

from bson import Binary, Code, Decimal128, Int64, MaxKey, MinKey, ObjectId, Regex, Timestamp

Document = dict[str, Any]


class _Missing:
    """A field absent from a document (distinct from an explicit null)."""

    _instance: ClassVar[_Missing | None] = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()

# https://www.mongodb.com/docs/manual/reference/bson-type-comparison-order/
RANK_MINKEY = 1
RANK_NULL = 2
RANK_NUMBER = 3
RANK_STRING = 4
RANK_OBJECT = 5
RANK_ARRAY = 6
RANK_BINARY = 7
RANK_OBJECTID = 8
RANK_BOOL = 9
RANK_DATE = 10
RANK_TIMESTAMP = 11
RANK_REGEX = 12
RANK_MAXKEY = 13


# Exact types that need no conversion: the common index keys (ids, names, numbers) take
# one dict lookup instead of the isinstance chain below, which dominated write profiles.
_PLAIN_RANKS: dict[type, int] = {
    str: RANK_STRING,
    int: RANK_NUMBER,
    float: RANK_NUMBER,
    bool: RANK_BOOL,
    ObjectId: RANK_OBJECTID,
}


# Values that are their own comparison and index key (a naive datetime as stored, UTC):
# the fast paths of matching (engine) and indexing (storage) take only these.
PLAIN_SCALARS = frozenset({str, int, Int64, float, bool, ObjectId, datetime.datetime})


def type_rank(value: Any) -> int:
    """Rank of the value's BSON type in MongoDB's cross-type comparison order."""
    plain = _PLAIN_RANKS.get(type(value))
    if plain is not None:
        return plain
    if type(value) is datetime.datetime:  # before the ABC checks below, which are slow
        return RANK_DATE
    if value is None or value is MISSING:
        return RANK_NULL
    if isinstance(value, bool):
        return RANK_BOOL
    if isinstance(value, int | float | Decimal128 | Decimal | Int64):
        return RANK_NUMBER
    if isinstance(value, str):
        return RANK_STRING
    if isinstance(value, Mapping):
        return RANK_OBJECT
    if isinstance(value, list | tuple):
        return RANK_ARRAY
    if isinstance(value, Binary | bytes | uuid.UUID):
        return RANK_BINARY
    if isinstance(value, ObjectId):
        return RANK_OBJECTID
    if isinstance(value, datetime.datetime):
        return RANK_DATE
    if isinstance(value, Timestamp):
        return RANK_TIMESTAMP
    if isinstance(value, Regex | re.Pattern):
        return RANK_REGEX
    if isinstance(value, MinKey):
        return RANK_MINKEY
    if isinstance(value, MaxKey):
        return RANK_MAXKEY
    return RANK_OBJECT


def _scalar(value: Any) -> Any:
    if isinstance(value, Decimal128):
        return value.to_decimal()
    if isinstance(value, datetime.datetime) and value.tzinfo is not None:
        return value.astimezone(datetime.UTC).replace(tzinfo=None)
    if isinstance(value, Timestamp):
        return (value.time, value.inc)
    if isinstance(value, Regex):
        return (value.pattern, value.flags)
    if isinstance(value, re.Pattern):
        return (value.pattern, int(value.flags))
    if isinstance(value, uuid.UUID):
        return value.bytes
    if isinstance(value, Code):
        return str(value)
    if isinstance(value, MinKey | MaxKey) or value is MISSING:
        return None
    return value


def key_of(value: Any) -> Hashable:
    """A hashable key equal for exactly the values MongoDB treats as equal.

    Used by hash indexes. Numbers of different widths share a key (1 == 1.0 == Int64(1)),
    a boolean never equals a number, and embedded documents compare field by field in order.
    """
    plain = _PLAIN_RANKS.get(type(value))
    if plain is not None:
        return (plain, value)
    if type(value) is datetime.datetime and value.tzinfo is None:  # as stored (UTC)
        return (RANK_DATE, value)
    rank = type_rank(value)
    if rank == RANK_OBJECT and isinstance(value, Mapping):
        return (rank, tuple((k, key_of(v)) for k, v in value.items()))
    if rank == RANK_ARRAY:
        return (rank, tuple(key_of(v) for v in value))
    return (rank, _scalar(value))


def sort_key(value: Any) -> tuple[Any, ...]:
    """A totally ordered key following MongoDB's comparison order, for sorted indexes."""
    plain = _PLAIN_RANKS.get(type(value))
    if plain is not None:
        return (plain, value)
    if type(value) is datetime.datetime and value.tzinfo is None:
        return (RANK_DATE, value)
    rank = type_rank(value)
    if rank == RANK_OBJECT and isinstance(value, Mapping):
        return (rank, tuple((k, sort_key(v)) for k, v in value.items()))
    if rank == RANK_ARRAY and isinstance(value, Sequence):
        return (rank, tuple(sort_key(v) for v in value))
    scalar = _scalar(value)
    if rank == RANK_NUMBER:
        scalar = float(scalar) if isinstance(scalar, Decimal) else scalar
    if scalar is None:
        return (rank,)
    return (rank, scalar)


def get_path(doc: Any, path: str) -> Any:
    """The value at a dotted path, or MISSING. Arrays along the path are not traversed."""
    current = doc
    for part in path.split("."):
        if isinstance(current, Mapping) and part in current:
            current = current[part]
        elif isinstance(current, list) and part.isdigit() and int(part) < len(current):
            current = current[int(part)]
        else:
            return MISSING
    return current


def index_values(doc: Mapping[str, Any], path: str) -> list[Any]:
    """Every value an index on ``path`` holds for ``doc`` (multikey: one per array element).

    The whole array is indexed too, so that an equality on the whole array still finds the
    document through the index; the index is only a candidate generator and the full
    filter is always applied afterwards.
    """
    value = doc.get(path, MISSING) if "." not in path else get_path(doc, path)
    if value is MISSING:
        # A dotted path through an array of subdocuments: {"a.b": 1} matches [{"b": 1}].
        head, _, rest = path.partition(".")
        parent = doc.get(head, MISSING) if isinstance(doc, Mapping) else MISSING
        if rest and isinstance(parent, list):
            found = [
                v for item in parent if isinstance(item, Mapping) for v in index_values(item, rest)
            ]
            return found or [None]
        return [None]
    if isinstance(value, list):
        return [value, *value] if value else [value, None]
    return [value]
