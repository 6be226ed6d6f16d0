"""Flow control across the fleet (pure): concurrency keys, rendered from a run.

A handler (``WorkerApp.handler(..., concurrency=...)``) or a schedule (its ``concurrency``
field, carried in each fire's event) declares ``{"key": <template>, "limit": N}``: at most
N runs whose template renders to the same key run at once, cluster-wide. A template is text
with fields in braces: ``{target}``, ``{schedule_id}``, ``{tenant}`` and
``{payload.<name>[.<name>...]}``; ``{{`` and ``}}`` are braces. The worker counts slots in
MongoDB (storage/flow.py) and parks the runs over their limit (docs/WORKERS.md).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hascheduler.core import triggers

MAX_TEMPLATE_CHARS = 200
MAX_KEY_CHARS = 300  # a rendered key: the slot documents' ids are built from it
MAX_LIMIT = 10_000
RUN_FIELDS = ("target", "schedule_id", "tenant")
_FIELD = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")


class KeyTemplateError(ValueError):
    """A template that cannot render (said when it is declared: a 422, a WorkerConfigError)."""


class MissingKeyField(ValueError):
    """A run lacks a field its key names (a payload without it, a fire without a tenant)."""


@dataclass(frozen=True, slots=True)
class KeyTemplate:
    text: str
    # Literal text and field paths in turn: ("tenants/", ("tenant",), "") for
    # "tenants/{tenant}"; a field path is ("payload", "account") for {payload.account}.
    parts: tuple[str | tuple[str, ...], ...]

    @classmethod
    def parse(cls, text: str) -> KeyTemplate:
        if not isinstance(text, str) or not text:
            raise KeyTemplateError("the key is a non-empty template such as '{tenant}'")
        if len(text) > MAX_TEMPLATE_CHARS:
            raise KeyTemplateError(f"the key template is at most {MAX_TEMPLATE_CHARS} characters")
        parts: list[str | tuple[str, ...]] = []
        literal, at = "", 0
        for match in _FIELD.finditer(text):
            literal += text[at : match.start()]
            at = match.end()
            token = match.group(0)
            if token in ("{{", "}}"):
                literal += token[0]
                continue
            if match.group(1) is None:
                raise KeyTemplateError(
                    f"unmatched {token!r} in the key template (a literal "
                    f"brace is written twice: '{token * 2}')"
                )
            parts.extend((literal, _field_path(match.group(1))))
            literal = ""
        parts.append(literal + text[at:])
        if not any(isinstance(p, tuple) for p in parts):
            raise KeyTemplateError(
                "the key template names no field: every run would share "
                "one key (name one, such as '{target}')"
            )
        return cls(text, tuple(parts))

    @property
    def fields(self) -> tuple[tuple[str, ...], ...]:
        return tuple(p for p in self.parts if isinstance(p, tuple))

    def render(self, run: Mapping[str, Any]) -> str:
        """The key of a run, from ``target``, ``schedule_id``, ``tenant`` and ``payload``;
        raises MissingKeyField naming what the run lacks."""
        out = []
        for part in self.parts:
            out.append(part if isinstance(part, str) else _value(run, part))
        key = "".join(out)
        if len(key) > MAX_KEY_CHARS:
            raise MissingKeyField(
                f"the key {self.text!r} renders to more than {MAX_KEY_CHARS} characters"
            )
        return key


def _field_path(inner: str) -> tuple[str, ...]:
    path = tuple(inner.strip().split("."))
    if path[0] == "payload":
        if len(path) < 2 or not all(_NAME.fullmatch(p) for p in path[1:]):
            raise KeyTemplateError(
                f"{{{inner}}}: a payload field is named {{payload.<name>[.<name>...]}}"
            )
        return path
    if len(path) != 1 or path[0] not in RUN_FIELDS:
        raise KeyTemplateError(
            f"{{{inner}}} is not a field of a run: use "
            + ", ".join(f"{{{f}}}" for f in RUN_FIELDS)
            + " or {payload.<name>}"
        )
    return path


def _value(run: Mapping[str, Any], path: tuple[str, ...]) -> str:
    value: Any = run
    for depth, name in enumerate(path):
        if not isinstance(value, Mapping) or value.get(name) is None:
            raise MissingKeyField(f"the run has no {'.'.join(path[: depth + 1])}")
        value = value[name]
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise MissingKeyField(f"{'.'.join(path)} is not text or a number")
    return str(value)


@dataclass(frozen=True, slots=True)
class ConcurrencyLimit:
    template: KeyTemplate
    limit: int

    @classmethod
    def of(cls, spec: Mapping[str, Any]) -> ConcurrencyLimit:
        """From ``{"key": ..., "limit": N}``; raises KeyTemplateError saying what is wrong."""
        if not isinstance(spec, Mapping) or set(spec) != {"key", "limit"}:
            raise KeyTemplateError('concurrency is {"key": <template>, "limit": N}')
        limit = spec["limit"]
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise KeyTemplateError(f"concurrency.limit is a whole number from 1 to {MAX_LIMIT}")
        return cls(KeyTemplate.parse(spec["key"]), limit)

    def spec(self) -> dict[str, Any]:
        return {"key": self.template.text, "limit": self.limit}


MAX_RATE_LIMIT = 100_000
MAX_RATE_PER_S = 86_400.0
MIN_RATE_INTERVAL_S = 0.001


@dataclass(frozen=True, slots=True)
class RateLimit:
    """At most ``limit`` run starts per ``per_s`` seconds for a key, evenly spaced (one
    every ``per_s / limit``: GCRA without a burst), cluster-wide."""

    template: KeyTemplate
    limit: int
    per_s: float

    @property
    def interval_s(self) -> float:
        return self.per_s / self.limit

    @classmethod
    def of(cls, spec: Mapping[str, Any]) -> RateLimit:
        """From ``{"key": ..., "limit": N, "per": "PT1S" | seconds}``; raises
        KeyTemplateError saying what is wrong."""
        if not isinstance(spec, Mapping) or set(spec) != {"key", "limit", "per"}:
            raise KeyTemplateError('rate is {"key": <template>, "limit": N, "per": "PT1S"}')
        limit, per = spec["limit"], spec["per"]
        if (
            isinstance(limit, bool)
            or not isinstance(limit, int)
            or not 1 <= limit <= MAX_RATE_LIMIT
        ):
            raise KeyTemplateError(f"rate.limit is a whole number from 1 to {MAX_RATE_LIMIT}")
        try:
            seconds = (
                triggers.parse_duration(per)
                if isinstance(per, str)
                else (
                    float(per)
                    if isinstance(per, int | float) and not isinstance(per, bool)
                    else -1.0
                )
            )
        except triggers.InvalidTrigger:
            seconds = -1.0
        if not 0 < seconds <= MAX_RATE_PER_S or seconds / limit < MIN_RATE_INTERVAL_S:
            raise KeyTemplateError(
                "rate.per is a duration ('PT1S', or seconds) up to a day, "
                "at least a millisecond per start"
            )
        return cls(KeyTemplate.parse(spec["key"]), limit, seconds)

    def spec(self) -> dict[str, Any]:
        return {"key": self.template.text, "limit": self.limit, "per": self.per_s}


@dataclass(frozen=True, slots=True)
class Paced:
    """A run's rate budget: its key rendered, one start per ``interval_s``."""

    key: str
    interval_s: float
    template: str


def paced(limit: RateLimit, run: Mapping[str, Any]) -> Paced:
    return Paced(limit.template.render(run), limit.interval_s, limit.template.text)


def check_for_schedule(
    limit: ConcurrencyLimit | RateLimit, payload: Mapping[str, Any], fans_out: bool
) -> None:
    """A schedule's own key must render for each of its fires: its payload has each
    field named, and ``{tenant}`` needs a fan-out. Raises KeyTemplateError naming it."""
    for path in limit.template.fields:
        if path == ("tenant",) and not fans_out:
            raise KeyTemplateError(
                "{tenant} names a fan-out fire's tenant: this schedule has no fan_out"
            )
        if path[0] == "payload":
            try:
                _value({"payload": payload}, path)
            except MissingKeyField as exc:
                raise KeyTemplateError(f"{{{'.'.join(path)}}}: {exc}") from None


# What one level of priority is worth in waiting: a run is served as if it had been
# waiting this much longer per level, so a priority-9 run overtakes runs that have waited
# up to 9 minutes, and none waits behind newer ones for ever (a priority-0 run that has
# waited 9 minutes goes before any priority-9 run parked after it).
PRIORITY_AGE_S = 60.0


def rank(priority: int, since: float) -> float:
    """The order in which waiting runs are served, lowest first: their waiting start
    (seconds, on any one clock), moved earlier by their priority."""
    return since - priority * PRIORITY_AGE_S


@dataclass(frozen=True, slots=True)
class Wanted:
    """A run's concurrency slot: its key rendered, the limit it counts against, and the
    template it came from (the metrics' label)."""

    key: str
    limit: int
    template: str


def wanted(limit: ConcurrencyLimit, run: Mapping[str, Any]) -> Wanted:
    return Wanted(limit.template.render(run), limit.limit, limit.template.text)
