"""The parts of a schedule that say when and how it runs (pure): its trigger (cron, interval,
one instant), what it is expected to do, and its run control (concurrency, rate)."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hascheduler.core import cron, flow, triggers
from hascheduler.core.constants import (
    MAX_INTERVAL_S,
    MAX_SUCCESS_WITHIN_S,
)
from hascheduler.core.fields import (
    Instant,
    Strict,
    context_now,
    min_interval,
    stored,
    utc_field,
    whole_ms,
    zone_enum,
)


class Window(Strict):
    """start_at and end_at: a trigger fires only within them."""

    start_at: Instant | None = Field(None, description="no fire before this instant")
    end_at: Instant | None = Field(None, description="no fire after this instant")

    @field_validator("start_at", "end_at")
    @classmethod
    def _aware(cls, value: dt.datetime | None, info: ValidationInfo) -> dt.datetime | None:
        return None if value is None else utc_field(value, info.field_name or "time")

    def _check_window(self, info: ValidationInfo) -> None:
        if self.end_at is not None:
            if self.start_at is not None and self.end_at <= self.start_at:
                raise ValueError("end_at must be after start_at")
            if not stored(info) and self.end_at <= context_now(info):
                raise ValueError("end_at must be in the future")


class CronSpec(Window):
    kind: Literal["cron"]
    cron: str = Field(
        max_length=cron.MAX_EXPRESSION_CHARS,
        json_schema_extra={"pattern": cron.SHAPE},
        description="5 fields (minute first) or 6 (second first) as crontab(5) "
        "reads them (day of month and day of week either match "
        "when both are restricted; day of week 0 or 7 = Sunday), "
        "the macros @hourly, @daily, @weekly, @monthly, @yearly, "
        "and L, LW, nW (day of month), nL, n#k (day of week)",
        examples=["0 9 * * mon", "*/5 * * * * *", "0 9 L * *", "@daily"],
    )
    timezone: str = Field("UTC", description="IANA time zone name", json_schema_extra=zone_enum)

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        triggers.zone(value)
        return value

    @model_validator(mode="after")
    def _parses(self, info: ValidationInfo) -> CronSpec:
        self._check_window(info)
        compiled = triggers.compile_cron(self.cron.strip(), self.timezone)
        self.cron = " ".join(self.cron.split())
        floor = min_interval(info)
        gap = compiled.expression.min_gap_s()
        if not stored(info) and gap < floor:
            raise ValueError(
                f"fires {gap:g} s apart at times; this cluster's floor is "
                f"{floor:g} s between two fires of one schedule"
            )
        return self

    def compile(self) -> triggers.Trigger:
        return triggers.bounded(triggers.Cron(self.cron, self.timezone), self.start_at, self.end_at)


class IntervalSpec(Strict):
    kind: Literal["interval"]
    every: float | str = Field(
        description="seconds, or an ISO-8601 duration such as 'PT30S'", examples=[30, "PT1H"]
    )
    start_at: Instant | None = Field(
        None, description="anchor of the grid start_at + k * every; defaults to creation time"
    )
    end_at: Instant | None = None

    @field_validator("every")
    @classmethod
    def _positive(cls, value: float | str, info: ValidationInfo) -> float:
        seconds = triggers.parse_duration(value) if isinstance(value, str) else float(value)
        if not seconds > 0:
            raise ValueError("every must be greater than 0 seconds")
        if seconds < 0.001:  # the catch-up's bisection resolves fires this far apart
            raise ValueError("every must be at least 1 millisecond")
        floor = min_interval(info)
        if seconds < floor and not stored(info):
            raise ValueError(
                f"every must be at least {floor:g} s (this cluster's floor "
                "between two fires of one schedule)"
            )
        if seconds > MAX_INTERVAL_S:
            raise ValueError(f"every must be at most {MAX_INTERVAL_S:.0f} seconds (10 years)")
        return seconds

    @field_validator("start_at", "end_at")
    @classmethod
    def _aware(cls, value: dt.datetime | None, info: ValidationInfo) -> dt.datetime | None:
        return None if value is None else utc_field(value, info.field_name or "time")

    @model_validator(mode="after")
    def _window(self, info: ValidationInfo) -> IntervalSpec:
        if self.end_at is not None:
            if self.start_at is not None and self.end_at <= self.start_at:
                raise ValueError("end_at must be after start_at")
            if not stored(info) and self.end_at <= context_now(info):
                raise ValueError("end_at must be in the future")
        return self

    def compile(self) -> triggers.Trigger:
        assert self.start_at is not None, "start_at is set when the schedule is stored"
        assert isinstance(self.every, float)
        return triggers.Interval(self.every, self.start_at, self.end_at)


class AtSpec(Window):
    kind: Literal["at"]
    at: Instant | list[Instant] = Field(
        description="one instant or a list of instants, each in the future"
    )

    @field_validator("at")
    @classmethod
    def _future(
        cls, value: dt.datetime | list[dt.datetime], info: ValidationInfo
    ) -> list[dt.datetime]:
        instants = value if isinstance(value, list) else [value]
        if not instants:
            raise ValueError("at needs at least one instant")
        if len(instants) > 10_000:
            raise ValueError("at holds at most 10000 instants")
        # To the millisecond, as they are stored (BSON dates): an instant within the
        # millisecond of the schedule's creation would not be after its stored creation
        # time, and nothing due by then is fired (replica/dispatch.py, replan_from).
        now = whole_ms(context_now(info))
        out = []
        for instant in instants:
            utc = utc_field(instant, "at")
            if whole_ms(utc) <= now and not stored(info):
                raise ValueError(
                    f"instant {utc.isoformat()} is not in the future (to the millisecond)"
                )
            out.append(utc)
        return sorted(set(out))

    @model_validator(mode="after")
    def _within(self, info: ValidationInfo) -> AtSpec:
        self._check_window(info)
        return self

    def compile(self) -> triggers.Trigger:
        assert isinstance(self.at, list)
        return triggers.bounded(triggers.At(tuple(self.at)), self.start_at, self.end_at)


TriggerSpec = Annotated[CronSpec | IntervalSpec | AtSpec, Field(discriminator="kind")]


class Expectation(Strict):
    """What a schedule promises its operators: an objective its health and metrics judge
    (core/health.py)."""

    success_within: float | str = Field(
        description="a run of it succeeds at least this often: seconds, or an ISO-8601 "
        "duration such as 'PT2H'",
        examples=["PT2H", 3600],
    )

    @field_validator("success_within")
    @classmethod
    def _seconds(cls, value: float | str) -> float:
        seconds = triggers.parse_duration(value) if isinstance(value, str) else float(value)
        if not 1 <= seconds <= MAX_SUCCESS_WITHIN_S:
            raise ValueError("success_within must be from 1 second to 400 days")
        return seconds


class ConcurrencySpec(Strict):
    """At most ``limit`` runs whose key renders alike run at once, across every worker
    (core/flow.py, docs/WORKERS.md)."""

    key: str = Field(
        min_length=1,
        max_length=flow.MAX_TEMPLATE_CHARS,
        description=(
            "a template over the run: {target}, {schedule_id}, {tenant}, {payload.<name>}"
        ),
        examples=["{tenant}", "{payload.account}"],
    )
    limit: int = Field(ge=1, le=flow.MAX_LIMIT)

    @field_validator("key")
    @classmethod
    def _template(cls, value: str) -> str:
        try:
            flow.KeyTemplate.parse(value)
        except flow.KeyTemplateError as exc:
            raise ValueError(str(exc)) from None
        return value


class RateSpec(Strict):
    """At most ``limit`` run starts per ``per`` for runs whose key renders alike, evenly
    spaced, across every worker (core/flow.py, docs/WORKERS.md)."""

    key: str = Field(
        min_length=1,
        max_length=flow.MAX_TEMPLATE_CHARS,
        description=("a template over the run, as concurrency.key"),
        examples=["{target}"],
    )
    limit: int = Field(ge=1, le=flow.MAX_RATE_LIMIT)
    per: float | str = Field(
        1.0, description="seconds, or an ISO-8601 duration", examples=["PT1S", 60]
    )

    @model_validator(mode="after")
    def _valid(self) -> RateSpec:
        try:
            flow.RateLimit.of(self.model_dump())
        except flow.KeyTemplateError as exc:
            raise ValueError(str(exc)) from None
        return self
