"""A stored schedule as the firing engine keeps it (pure): compact (no payload, name or
labels), a compiled trigger and the few fields firing needs. Every replica's mirror holds
one per schedule; an audit builds them to say what was due."""

from __future__ import annotations

import dataclasses
import datetime as dt
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from hascheduler.core import triggers
from hascheduler.core.fanout import FanOut
from hascheduler.core.instants import as_utc


@dataclass(frozen=True, slots=True)
class _Uncommon:
    """An entry's settings that most schedules leave at their defaults."""

    fan_out: FanOut | None = None
    overlap: str = "allow"  # core/overlap.py
    paused_until: dt.datetime | None = None
    max_fires: int | None = None
    completed: bool = False
    namespace: str = "default"
    success_within: float | None = None
    paused_since: dt.datetime | None = None


class Written(NamedTuple):
    """When a change to a schedule was made, as its change event says: ``at``, when the
    database committed it (the event's ``wallTime``: none from a server before MongoDB
    6.0), and, for a new schedule (an insert), ``created_at``, its document's creation
    time (the API's clock when it took the request: before the commit, and by as much as
    the write was held up). A resync, which has no events, takes both from the document:
    ``at`` is its ``updated_at`` (the API's clock again)."""

    at: dt.datetime | None
    created_at: dt.datetime | None


_DEFAULTS = _Uncommon()
_DEFAULT_VALUES = dataclasses.astuple(_DEFAULTS)


class Entry:
    """One schedule as the firing engine keeps it.

    Compact because every replica holds one per schedule: the settings most schedules
    leave at their defaults live in one shared object until a schedule sets one (bytes
    per schedule against the documents' BSON size: docs/BENCHMARKS.md, Schedules)."""

    __slots__ = (
        "_uncommon",
        "catchup",
        "catchup_window",
        "jitter",
        "paused",
        "revision",
        "target",
        "trigger",
    )

    def __init__(  # noqa: PLR0913 (a record of the fields firing reads)
        self,
        revision: int,
        paused: bool,
        trigger: triggers.Trigger,
        jitter: float,
        catchup: str,
        catchup_window: float,
        target: str,
        fan_out: FanOut | None = _DEFAULTS.fan_out,
        overlap: str = _DEFAULTS.overlap,
        paused_until: dt.datetime | None = _DEFAULTS.paused_until,
        max_fires: int | None = _DEFAULTS.max_fires,
        completed: bool = _DEFAULTS.completed,
        namespace: str = _DEFAULTS.namespace,
        success_within: float | None = _DEFAULTS.success_within,
        paused_since: dt.datetime | None = _DEFAULTS.paused_since,
    ) -> None:
        self.revision = revision
        self.paused = paused
        self.trigger = trigger
        self.jitter = jitter
        self.catchup = catchup
        self.catchup_window = catchup_window
        self.target = target
        uncommon = (
            fan_out,
            overlap,
            paused_until,
            max_fires,
            completed,
            namespace,
            success_within,
            paused_since,
        )
        self._uncommon = _DEFAULTS if uncommon == _DEFAULT_VALUES else _Uncommon(*uncommon)

    @property
    def fan_out(self) -> FanOut | None:
        return self._uncommon.fan_out

    @property
    def overlap(self) -> str:
        return self._uncommon.overlap

    @property
    def paused_until(self) -> dt.datetime | None:
        """Paused with an end (POST /schedules/{id}/pause {"until": ...}): fires from this
        instant on, whether or not the leader has written the resume yet."""
        return self._uncommon.paused_until

    @property
    def paused_since(self) -> dt.datetime | None:
        """When the pause route paused it (its record's ``at``, on the database's clock):
        its instants before that were due. None: paused by a write saying ``paused``, from
        no known instant."""
        return self._uncommon.paused_since

    @property
    def max_fires(self) -> int | None:
        return self._uncommon.max_fires

    @property
    def completed(self) -> bool:
        """Its max_fires fires were published."""
        return self._uncommon.completed

    @property
    def namespace(self) -> str:
        """Whose fire-rate quota its fires count against."""
        return self._uncommon.namespace

    @property
    def success_within(self) -> float | None:
        """expect.success_within: it has health metrics."""
        return self._uncommon.success_within

    def replace(self, **changes: Any) -> Entry:
        """A copy with ``changes`` (any constructor argument)."""
        fields = {name: getattr(self, name) for name in _FIELDS}
        fields.update(changes)
        return Entry(**fields)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Entry) and all(
            getattr(self, name) == getattr(other, name) for name in _FIELDS
        )

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass it replaced

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in _FIELDS)
        return f"Entry({shown})"

    @property
    def dormant(self) -> bool:
        """Paused for good, or completed: nothing of it is queued until that changes."""
        return self.completed or (self.paused and self.paused_until is None)

    def paused_at(self, nominal: dt.datetime) -> bool:
        """Not to fire at ``nominal``: paused then (from its pause's start, when known, to
        its end, if any), or completed."""
        since, until = self.paused_since, self.paused_until
        return self.completed or (
            self.paused
            and (since is None or nominal >= since)
            and (until is None or nominal < until)
        )

    def paused_now(self, now: dt.datetime) -> bool:
        """Paused at ``now``: nothing of it is published (a backfill, a buffered fire)."""
        return self.paused and (self.paused_until is None or now < self.paused_until)


# Every constructor argument: the ones kept on the entry, then the uncommon ones.
_FIELDS = (
    *(name for name in Entry.__slots__ if name != "_uncommon"),
    *(f.name for f in dataclasses.fields(_Uncommon)),
)


def compile_trigger(spec: dict[str, Any]) -> triggers.Trigger:
    """A stored trigger document as a Trigger (stored documents were validated on write).

    Raises InvalidTrigger, KeyError or TypeError for a document not written by us.
    """
    kind = spec["kind"]
    if kind == "cron":
        expression = sys.intern(spec["cron"])
        timezone = sys.intern(spec.get("timezone", "UTC"))
        triggers.compile_cron(expression, timezone)  # validate once, interned
        return triggers.bounded(
            _interned_cron(expression, timezone), _window(spec, "start_at"), _window(spec, "end_at")
        )
    if kind == "interval":
        return triggers.Interval(
            _shared(float(spec["every"])),
            _aware(spec["start_at"]),
            _aware(spec["end_at"]) if spec.get("end_at") else None,
        )
    if kind == "at":
        return triggers.bounded(
            triggers.At(tuple(_aware(t) for t in spec["at"])),
            _window(spec, "start_at"),
            _window(spec, "end_at"),
        )
    raise triggers.InvalidTrigger(f"unknown trigger kind {kind!r}")


_crons: dict[tuple[str, str], triggers.Cron] = {}
_floats: dict[float, float] = {}
SHARED_FLOATS = 4096


def _shared(value: float) -> float:
    """One object per distinct value, for the few a fleet's schedules use (jitters,
    catch-up windows, intervals): each decoded document brings a new 24-byte float."""
    shared = _floats.get(value)
    if shared is not None:
        return shared
    if len(_floats) < SHARED_FLOATS and value == value:  # NaN never finds itself
        _floats[value] = value
    return value


def _interned_cron(expression: str, timezone: str) -> triggers.Cron:
    key = (expression, timezone)
    cron = _crons.get(key)
    if cron is None:
        cron = _crons[key] = triggers.Cron(expression, timezone)
    return cron


def _window(spec: dict[str, Any], name: str) -> dt.datetime | None:
    value = spec.get(name)
    return _aware(value) if value is not None else None


def _aware(value: dt.datetime) -> dt.datetime:
    aware: dt.datetime = as_utc(value)
    return aware


def entry_from_document(doc: dict[str, Any]) -> Entry:
    return Entry(
        revision=int(doc["revision"]),
        paused=bool(doc.get("paused", False)),
        trigger=compile_trigger(doc["trigger"]),
        jitter=_shared(float(doc.get("jitter", 0.0))),
        catchup=sys.intern(doc.get("catchup", "latest")),
        catchup_window=_shared(float(doc.get("catchup_window", 3600.0))),
        target=sys.intern(doc["target"]),
        fan_out=FanOut.model_validate(doc["fan_out"]) if doc.get("fan_out") else None,
        overlap=sys.intern(doc.get("overlap", "allow")),
        paused_until=_paused_until(doc),
        max_fires=doc.get("max_fires"),
        completed=bool(doc.get("completed", False)),
        namespace=sys.intern(doc.get("namespace") or "default"),
        success_within=_success_within(doc),
        paused_since=_pause_field(doc, "at"),
    )


def _success_within(doc: dict[str, Any]) -> float | None:
    expect = doc.get("expect")
    within = expect.get("success_within") if isinstance(expect, dict) else None
    return float(within) if isinstance(within, (int, float)) else None


def _paused_until(doc: dict[str, Any]) -> dt.datetime | None:
    return _pause_field(doc, "until")


def _pause_field(doc: dict[str, Any], name: str) -> dt.datetime | None:
    pause = doc.get("pause") if doc.get("paused") else None
    value = pause.get(name) if isinstance(pause, dict) else None
    return as_utc(value) if isinstance(value, dt.datetime) else None


def namespace_of(entries: Mapping[str, Entry], schedule_id: str) -> str | None:
    """The namespace of a mirrored schedule (None once it is gone)."""
    entry = entries.get(schedule_id)
    return entry.namespace if entry is not None else None
