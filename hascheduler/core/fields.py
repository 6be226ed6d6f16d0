"""What every API model validates alike (pure): instants in RFC 3339, namespaces, payloads
BSON can store, the strict base model, and what a validation's context says (a stored
schedule, now, the floor on how often one may fire)."""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    JsonValue,
    ValidationInfo,
)

from hascheduler.core import triggers
from hascheduler.core.constants import (
    DEFAULT_MIN_FIRE_INTERVAL_S,
    MAX_PAYLOAD_BYTES,
)

# Schedule ids and label keys, matched whole (fullmatch).
SLUG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


# A namespace is a DNS label, as Kubernetes names them: it appears in URLs, metric labels
# and file names, so no character there needs escaping.
NAMESPACE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")


DEFAULT_NAMESPACE = "default"
# The namespace a change to runs is recorded in when their schedule is gone.
UNKNOWN_NAMESPACE = "(unknown: its schedule no longer exists)"


def stored(info: ValidationInfo) -> bool:
    """Validating a schedule read back from MongoDB: its instants may have passed since."""
    return bool((info.context or {}).get("stored"))


def context_now(info: ValidationInfo) -> dt.datetime:
    context = info.context or {}
    now = context.get("now")
    return now if isinstance(now, dt.datetime) else dt.datetime.now(dt.UTC)


def min_interval(info: ValidationInfo) -> float:
    """The floor on how often one schedule may fire (``serve --min-fire-interval``)."""
    floor = (info.context or {}).get("min_fire_interval_s")
    return float(floor) if isinstance(floor, int | float) else DEFAULT_MIN_FIRE_INTERVAL_S


# RFC 3339, as JSON Schema's date-time format says (pydantic alone also takes numbers and
# numeric strings as Unix times).
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")


def parse_instant(text: str) -> dt.datetime:
    """An RFC 3339 date-time with an offset, as the API takes every instant (bodies and
    query parameters alike). Raises ValueError."""
    if not _RFC3339.fullmatch(text):
        raise ValueError(
            "must be an RFC 3339 date-time with an offset, such as '2030-01-01T09:00:00Z'"
        )
    return dt.datetime.fromisoformat(text.upper())


def _instant(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value
    if isinstance(value, str):
        return parse_instant(value)
    raise ValueError("must be an RFC 3339 date-time with an offset, such as '2030-01-01T09:00:00Z'")


Instant = Annotated[dt.datetime, BeforeValidator(_instant)]


def utc_field(value: dt.datetime, field: str) -> dt.datetime:
    if value.tzinfo is None:
        raise ValueError(f"{field} needs a time zone offset (for example 'Z' or '+02:00')")
    return value.astimezone(dt.UTC)


def whole_ms(value: dt.datetime) -> dt.datetime:
    return value.replace(microsecond=value.microsecond - value.microsecond % 1000)


_INT64 = 2**63


# How deep a request body may nest: a schedule's payload sits two levels into its
# document, and BSON refuses a document nested past 100 levels.
MAX_JSON_DEPTH = 64
_OPENING, _CLOSING = frozenset(b"[{"), frozenset(b"]}")


def json_depth(raw: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep ``raw`` (JSON text) nests, counted without parsing it, up to one past
    ``limit``: a parser asked to read 60,000 brackets runs out of stack."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in _OPENING:
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif byte in _CLOSING:
            depth -= 1
    return deepest


def not_a_number(name: str) -> Any:
    """``json.loads``'s parse_constant: NaN and the infinities are not JSON numbers, and a
    stored NaN read back as null."""
    raise ValueError(f"{name} is not a JSON number")


def loads(raw: bytes | str) -> Any:
    """JSON text as a value, refusing (ValueError, saying why) what no input may hold:
    nesting past MAX_JSON_DEPTH, NaN and the infinities."""
    data = raw.encode() if isinstance(raw, str) else raw
    if json_depth(data) > MAX_JSON_DEPTH:
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep")
    return json.loads(data, parse_constant=not_a_number)


def storable(value: Any, path: str) -> None:
    """Refuse what JSON allows but BSON cannot store: NUL in keys, integers beyond 64 bits,
    numbers that are not finite (read back as null), nesting past MAX_JSON_DEPTH."""
    _storable(value, path, 0)


def _storable(value: Any, path: str, depth: int) -> None:
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"{path}: nested more than {MAX_JSON_DEPTH} levels deep")
    if isinstance(value, dict):
        for key, item in value.items():
            if "\0" in key:
                raise ValueError(f"{path}: field names cannot contain the NUL character")
            _storable(item, f"{path}.{key}", depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _storable(item, f"{path}[{i}]", depth + 1)
    elif isinstance(value, int) and not isinstance(value, bool) and not -_INT64 <= value < _INT64:
        raise ValueError(f"{path}: integers must fit in 64 bits")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{path}: numbers must be finite")


def checked_payload(value: dict[str, Any]) -> dict[str, Any]:
    size = len(json.dumps(value, separators=(",", ":"), default=str).encode())
    if size > MAX_PAYLOAD_BYTES:
        raise ValueError(f"payload is {size} bytes as JSON; the limit is {MAX_PAYLOAD_BYTES}")
    storable(value, "payload")
    return value


def _checked_namespace(value: str) -> str:
    if not NAMESPACE.fullmatch(value):
        raise ValueError(
            "namespace must be a DNS label: 1-63 lowercase letters, digits "
            "or '-', starting and ending with a letter or digit"
        )
    return value


NamespaceName = Annotated[str, AfterValidator(_checked_namespace)]


class Strict(BaseModel):
    # Strict: JSON types are taken as written ("30" is not a number, true not 1), so the
    # OpenAPI document the models give is exactly what the API accepts.
    model_config = ConfigDict(extra="forbid", strict=True)


def zone_enum(schema: dict[str, JsonValue]) -> None:
    # A callable: the zone database is read when the OpenAPI document is made, not when
    # the models are imported.
    schema["enum"] = [*sorted(triggers.zone_names())]
