"""Fan-out: what a schedule's ``fan_out`` names, and which documents it selects (pure).

A fan-out source is a collection in the schedules' database, a filter of simple conditions
on its documents, and the field whose value is each tenant's key. Every replica mirrors the
documents a source names (only their keys and the fields the filter needs); at each fire
the leader publishes one message per matching tenant. This module holds the rules every
one of those steps shares: what a valid source is, which fields to mirror, whether a
document matches, what a tenant's key is as text, and a tenant's fire id.

The filter language is deliberately small, so that matching in the mirror is exact and
cheap: each condition is an equality to a scalar, ``{"$in": [scalars]}`` or
``{"$exists": bool}``, on a dotted field path; conditions are ANDed.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from typing import Any

from bson import ObjectId
from pydantic import BaseModel, ConfigDict, Field, field_validator

from hascheduler.core.constants import OWN_COLLECTIONS
from hascheduler.core.triggers import fire_id

# MongoDB's own rules for a collection name, plus ours: never one of the cluster's own
# collections, never a system collection.
COLLECTION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,119}")
# A field path: dot-separated names, none starting with $ (an operator) or empty.
FIELD_PATH = re.compile(r"[A-Za-z0-9_-]{1,64}(\.[A-Za-z0-9_-]{1,64}){0,7}")
MAX_CONDITIONS = 16
MAX_IN_VALUES = 1000
MAX_SCALAR_CHARS = 256
# A tenant key becomes part of a fire id and a broker message id: printable, bounded.
MAX_TENANT_KEY_CHARS = 200
_TENANT_KEY = re.compile(rf"[^\x00-\x1f\x7f]{{1,{MAX_TENANT_KEY_CHARS}}}")

Scalar = str | int | float | bool | None


class FanOutError(ValueError):
    """A fan-out source that cannot be used (the message names the part)."""


def _scalar(value: Any, where: str) -> Scalar:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        if not -(2**63) <= value < 2**63:
            raise FanOutError(f"{where}: integers must fit in 64 bits")
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise FanOutError(f"{where}: numbers must be finite")
        return value
    if isinstance(value, str):
        if len(value) > MAX_SCALAR_CHARS:
            raise FanOutError(f"{where}: strings are at most {MAX_SCALAR_CHARS} characters")
        return value
    raise FanOutError(f"{where}: a value must be a string, number, boolean or null")


def check_condition(path: str, condition: Any) -> Any:
    """One filter entry, normalised; raises FanOutError naming ``filter.<path>``."""
    where = f"filter.{path}"
    if not isinstance(path, str) or not FIELD_PATH.fullmatch(path):
        raise FanOutError(
            f"{where}: a field path is dot-separated names of letters, digits, _ and - (no $)"
        )
    if isinstance(condition, Mapping):
        if len(condition) != 1:
            raise FanOutError(f"{where}: use one operator per field ($in or $exists)")
        [(operator, operand)] = condition.items()
        if operator == "$in":
            if not isinstance(operand, list) or not 0 < len(operand) <= MAX_IN_VALUES:
                raise FanOutError(f"{where}.$in: a list of 1 to {MAX_IN_VALUES} values")
            return {"$in": [_scalar(v, f"{where}.$in") for v in operand]}
        if operator == "$exists":
            if not isinstance(operand, bool):
                raise FanOutError(f"{where}.$exists: true or false")
            return {"$exists": operand}
        raise FanOutError(f"{where}: only equality, $in and $exists are supported")
    return _scalar(condition, where)


class FanOut(BaseModel):
    """``"fan_out": {"collection": ..., "filter": {...}, "key": "_id"}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    collection: str = Field(description="a collection in the schedules' database")
    filter: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            'conditions ANDed on dotted field paths: a scalar (equality), {"$in": [...]} or '
            '{"$exists": true|false}'
        ),
    )
    key: str = Field(default="_id", description="the field whose value names each tenant")

    @field_validator("collection")
    @classmethod
    def _collection(cls, value: str) -> str:
        if not COLLECTION.fullmatch(value) or value.startswith("system."):
            raise ValueError(
                "a collection name: letters, digits, _, . and -, at most 120 "
                "characters, not a system collection"
            )
        if value in OWN_COLLECTIONS:
            raise ValueError(f"{value!r} is one of hascheduler's own collections")
        return value

    @field_validator("filter")
    @classmethod
    def _filter(cls, value: dict[str, Any]) -> dict[str, Any]:
        if len(value) > MAX_CONDITIONS:
            raise ValueError(f"at most {MAX_CONDITIONS} conditions")
        try:
            return {path: check_condition(path, condition) for path, condition in value.items()}
        except FanOutError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("key")
    @classmethod
    def _key(cls, value: str) -> str:
        if not FIELD_PATH.fullmatch(value):
            raise ValueError("a field path: dot-separated names of letters, digits, _ and -")
        return value

    def fields(self) -> list[str]:
        """What the mirror keeps of each document: the key and the filter's fields."""
        return sorted({self.key, *self.filter})

    def source(self) -> tuple[str, tuple[str, ...]]:
        """The mirrored source this fan-out reads: schedules sharing a collection and its
        fields share one mirror."""
        return self.collection, tuple(self.fields())


MISSING = object()  # what lookup answers for a path the document lacks


def lookup(document: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted path, or MISSING (arrays are not traversed: a tenant
    document's key and filter fields are plain values)."""
    value: Any = document
    for name in path.split("."):
        if not isinstance(value, Mapping) or name not in value:
            return MISSING
        value = value[name]
    return value


def _equal(have: Any, want: Scalar) -> bool:
    if isinstance(want, bool) or isinstance(have, bool):
        return type(have) is type(want) and have == want
    return bool(have == want)


def matches(fan_out: FanOut, document: Mapping[str, Any]) -> bool:
    """Whether ``document`` is one of the fan-out's tenants, as MongoDB would match the
    filter (no array traversal: a field holding an array never matches a scalar)."""
    for path, condition in fan_out.filter.items():
        have = lookup(document, path)
        if isinstance(condition, dict) and "$exists" in condition:
            if (have is not MISSING) != condition["$exists"]:
                return False
        elif isinstance(condition, dict):
            if have is MISSING:  # as for equality, null stands for a missing field too
                if None not in condition["$in"]:
                    return False
            elif not any(_equal(have, v) for v in condition["$in"]):
                return False
        elif condition is None:
            if have is not MISSING and have is not None:
                return False
        elif have is MISSING or not _equal(have, condition):
            return False
    return True


def tenant_key(document: Mapping[str, Any], key: str) -> str | None:
    """The tenant's key as text (an ObjectId as its hex, a whole number as its digits), or
    None when the document has no usable one (missing, another type, too long, control
    characters): such a document is skipped, never published."""
    value = lookup(document, key)
    if isinstance(value, ObjectId):
        return str(value)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str) and _TENANT_KEY.fullmatch(value):
        return value
    return None


def tenant_fire_id(schedule_id: str, nominal: dt.datetime, tenant: str) -> str:
    """``<schedule_id>@<nominal UTC>/<tenant key>``: the fire id of one tenant's run."""
    return f"{fire_id(schedule_id, nominal)}/{tenant}"
