"""The schedule as the API accepts it and as MongoDB stores it (pydantic v2).

Validation needs "now" (instants must lie in the future): callers pass it in the
validation context, ``{"now": datetime}``, so the rules stay pure and testable."""

from __future__ import annotations

import datetime as dt
import urllib.parse
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hascheduler.core import flow, triggers
from hascheduler.core.catchup import MAX_CATCHUP_FIRES
from hascheduler.core.celery_message import CeleryPayloadError, celery_call, celery_task
from hascheduler.core.constants import (
    MAX_BATCH,
    MAX_FIRES,
    MAX_JITTER_S,
    MAX_TARGET_CHARS,
    TARGET_PATTERN,
)
from hascheduler.core.fanout import FanOut
from hascheduler.core.fields import (
    DEFAULT_NAMESPACE,
    NAMESPACE,
    SLUG,
    Instant,
    NamespaceName,
    Strict,
    checked_payload,
    context_now,
    utc_field,
)
from hascheduler.core.health import ScheduleHealth
from hascheduler.core.overlap import Policy
from hascheduler.core.specs import (
    ConcurrencySpec,
    CronSpec,
    Expectation,
    IntervalSpec,
    RateSpec,
    TriggerSpec,
)


class ScheduleFields(Strict):
    """What a client writes: everything but the server-managed fields."""

    name: str = Field(min_length=1, max_length=200)
    namespace: NamespaceName = Field(
        DEFAULT_NAMESPACE,
        max_length=63,
        description=(
            "the team's namespace: who may act on the schedule, its fires and runs; ids stay "
            "unique across namespaces"
        ),
        json_schema_extra={"pattern": f"^{NAMESPACE.pattern}$"},
    )
    trigger: TriggerSpec
    jitter: float = Field(
        0.0,
        ge=0,
        le=MAX_JITTER_S,
        description="max seconds added to each fire, chosen "
        "deterministically from (id, nominal time)",
    )
    paused: bool = False
    catchup: Literal["latest", "all", "none"] = Field(
        "latest",
        description="after downtime: fire only the latest missed time, all of "
        "them within catchup_window, or none",
    )
    catchup_window: float = Field(
        3600.0, gt=0, le=30 * 86400, description="seconds of missed fires replayed with 'all'"
    )
    target: str = Field(
        min_length=1,
        max_length=MAX_TARGET_CHARS,
        description="broker subject suffix or routing key; celery:<task> "
        "sends a Celery task (an amqp:// broker only), its "
        "payload {args, kwargs, queue}",
        examples=["reports.weekly", "celery:proj.tasks.send_report"],
        json_schema_extra={"pattern": f"^(celery:)?{TARGET_PATTERN.pattern}$"},
    )
    payload: dict[str, Any] = Field(default_factory=dict)
    fan_out: FanOut | None = Field(
        None,
        description=(
            "one run per tenant: at each fire, one message per document of this collection "
            "(in the same database) that the filter selects at the due time, its key in "
            "data.tenant and the fire id <schedule_id>@<nominal>/<tenant>"
        ),
    )
    overlap: Policy = Field(
        "allow",
        description="what a fire does while this schedule's previous run is open "
        "(published, not yet succeeded, dead or cancelled): allow it "
        "beside, skip it, buffer one (or all, bounded) until the run "
        "ends, or cancel the open run and start once it has ended; "
        "per tenant for a fan-out (docs/SCHEDULES.md)",
    )
    max_fires: int | None = Field(
        None,
        ge=1,
        le=MAX_FIRES,
        description="after this many published fires (runs now "
        "not counted) the schedule is completed: "
        "kept, firing no more; raising it revives it",
    )
    pause_on_failure: int | None = Field(
        None,
        ge=1,
        le=1000,
        description="pause the schedule (with a note saying why and "
        "the last error) after this many consecutive dead "
        "runs",
    )
    expect: Expectation | None = Field(
        None,
        description="an objective: its health says whether it is met, and the "
        "schedule gets metrics of its own (docs/OPERATIONS.md)",
    )
    concurrency: ConcurrencySpec | None = Field(
        None,
        description="a concurrency limit by key for this schedule's runs, across "
        "every worker (instead of its handler's, if that declares one): "
        "runs over it wait, state 'waiting' (docs/WORKERS.md)",
    )
    rate: RateSpec | None = Field(
        None,
        description="a start-rate limit by key for this schedule's runs, across every "
        "worker (instead of its handler's): runs over it wait",
    )
    priority: int = Field(
        0,
        ge=0,
        le=9,
        description=(
            "under contention for a concurrency or rate limit, or for a worker's slots, "
            "higher first (docs/WORKERS.md)"
        ),
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        json_schema_extra={
            "maxProperties": 64,
            "propertyNames": {"pattern": f"^{SLUG.pattern}$"},
            "additionalProperties": {"type": "string", "maxLength": 200},
        },
    )

    @field_validator("catchup_window")
    @classmethod
    def _bounded_replay(cls, value: float, info: ValidationInfo) -> float:
        """A window that would replay more fires than one catch-up may is refused: after an
        outage, 'all' claims and publishes every time inside it."""
        trigger, policy = info.data.get("trigger"), info.data.get("catchup")
        gap: float | None = None
        if isinstance(trigger, CronSpec):
            gap = triggers.compile_cron(trigger.cron, trigger.timezone).expression.min_gap_s()
        elif isinstance(trigger, IntervalSpec) and isinstance(trigger.every, float):
            gap = trigger.every
        if policy == "all" and gap and value / gap > MAX_CATCHUP_FIRES:
            raise ValueError(
                f"with catchup 'all' this window replays up to {value / gap:.0f} "
                f"fires after an outage; at most {MAX_CATCHUP_FIRES} (shorten "
                "the window or fire less often)"
            )
        return value

    @field_validator("target")
    @classmethod
    def _target(cls, value: str) -> str:
        if not TARGET_PATTERN.fullmatch(celery_task(value) or value):
            raise ValueError(
                "target must be dot-separated tokens of letters, digits, '_' "
                "or '-', optionally after celery:"
            )
        return value

    @model_validator(mode="after")
    def _celery_payload(self) -> ScheduleFields:
        """A Celery target's payload is the call: checked when written, not at each fire."""
        if celery_task(self.target) is not None:
            try:
                celery_call(self.payload)
            except CeleryPayloadError as exc:
                raise ValueError(str(exc)) from None
        return self

    @field_validator("payload")
    @classmethod
    def _small(cls, value: dict[str, Any]) -> dict[str, Any]:
        return checked_payload(value)

    @field_validator("concurrency", "rate")
    @classmethod
    def _flow_key(
        cls, value: ConcurrencySpec | RateSpec | None, info: ValidationInfo
    ) -> ConcurrencySpec | RateSpec | None:
        """The key renders for every fire: each payload field it names is there."""
        if value is not None:
            limit = (
                flow.ConcurrencyLimit.of(value.model_dump())
                if isinstance(value, ConcurrencySpec)
                else flow.RateLimit.of(value.model_dump())
            )
            try:
                flow.check_for_schedule(
                    limit, info.data.get("payload") or {}, info.data.get("fan_out") is not None
                )
            except flow.KeyTemplateError as exc:
                raise ValueError(f"key: {exc}") from None
        return value

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > 64:
            raise ValueError("at most 64 labels")
        for key, text in value.items():
            if not SLUG.fullmatch(key) or len(text) > 200:
                raise ValueError(f"label {key!r}: keys are slugs, values at most 200 chars")
        return value


class ScheduleIn(ScheduleFields):
    """A new schedule: the id is optional (the server makes one)."""

    id: str | None = Field(
        None,
        description="a slug; generated when absent",
        json_schema_extra={"pattern": f"^{SLUG.pattern}$"},
    )

    @field_validator("id")
    @classmethod
    def _slug(cls, value: str | None) -> str | None:
        if value is not None and not SLUG.fullmatch(value):
            raise ValueError(
                "id must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        return value


class ScheduleBatchIn(Strict):
    """Many new schedules in one request (POST /schedules:batch): all are checked before
    any is written."""

    schedules: list[ScheduleIn] = Field(min_length=1, max_length=MAX_BATCH)


class BatchCreated(BaseModel):
    created: list[str] = Field(description="the ids created")
    existing: list[str] = Field(description="ids taken already: left as they were")


class RestoreIn(Strict):
    """Which earlier revision to put back (POST /schedules/{id}/restore)."""

    revision: int = Field(ge=1, description="a revision in the schedule's history")


class PauseIn(Strict):
    """Why, and for how long, a schedule is paused (POST /schedules/{id}/pause)."""

    note: str | None = Field(None, max_length=1000)
    until: Instant | None = Field(
        None, description="resume by itself at this instant (in the future)"
    )

    @field_validator("until")
    @classmethod
    def _future(cls, value: dt.datetime | None, info: ValidationInfo) -> dt.datetime | None:
        if value is None:
            return None
        utc = utc_field(value, "until")
        if utc <= context_now(info):
            raise ValueError("until must be in the future")
        return utc


class Pause(BaseModel):
    """Who paused a schedule, when, why and until when (server-managed)."""

    by: str
    at: dt.datetime
    note: str | None = None
    until: dt.datetime | None = None


class Schedule(ScheduleFields):
    """A stored schedule, as the API returns it."""

    model_config = ConfigDict(extra="ignore")

    id: str
    pause: Pause | None = Field(
        None, description="set while paused through the pause route or by pause_on_failure"
    )
    completed: bool = Field(False, description="its max_fires fires were published")
    fires_remaining: int | None = Field(
        None, description="with max_fires: how many more it fires (GET of one schedule)"
    )
    created_at: dt.datetime
    updated_at: dt.datetime
    revision: int = Field(ge=1)

    def compile(self) -> triggers.Trigger:
        return self.trigger.compile()


class TriggerIn(Strict):
    """A request to run a schedule now (POST /schedules/{id}/trigger)."""

    payload: dict[str, Any] | None = Field(
        None, description="this fire's payload, instead of the schedule's"
    )
    overlap: Policy | None = Field(
        None, description="this fire's overlap policy, instead of the schedule's"
    )
    force: bool = Field(False, description="run a paused schedule too")
    priority: int | None = Field(
        None, ge=0, le=9, description="this fire's priority, instead of the schedule's"
    )

    @field_validator("payload")
    @classmethod
    def _small(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else checked_payload(value)


class BackfillIn(Strict):
    """A request to fire a schedule's nominal times in a past range."""

    start: Instant = Field(description="the first nominal time it may fire (inclusive)")
    end: Instant = Field(description="exclusive; not in the future")
    overlap: Policy | None = Field(
        None, description="the backfilled fires' overlap policy, instead of the schedule's"
    )

    @field_validator("start")
    @classmethod
    def _aware(cls, value: dt.datetime) -> dt.datetime:
        return utc_field(value, "start")

    @field_validator("end")
    @classmethod
    def _past_range(cls, value: dt.datetime, info: ValidationInfo) -> dt.datetime:
        end = utc_field(value, "end")
        start = info.data.get("start")
        if isinstance(start, dt.datetime) and end <= start:
            raise ValueError("end must be after start")
        if end > context_now(info):
            raise ValueError(
                "end is in the future: a backfill fires past times only (the "
                "trigger fires the rest)"
            )
        return end


class Triggered(BaseModel):
    fire_id: str = Field(
        description="<schedule id>@manual-<request instant>; a fan-out's "
        "tenants' fires are <fire_id>/<tenant>"
    )
    url: str = Field(description="its ledger entry")
    created: bool = Field(
        description="false when an earlier request with the same Idempotency-Key made this fire"
    )


WebhookEvent = Literal[
    "run.dead", "fire.skipped", "fire.failed", "schedule.paused", "schedule.late"
]


WEBHOOK_EVENTS: tuple[str, ...] = get_args(WebhookEvent)


MAX_WEBHOOK_URL_CHARS = 2048


class WebhookIn(Strict):
    """A webhook: the events of a namespace (or of one of its schedules) POSTed to a URL,
    signed with its secret (docs/OPERATIONS.md, "Webhooks")."""

    id: str | None = Field(
        None,
        description="a slug; generated when absent",
        json_schema_extra={"pattern": f"^{SLUG.pattern}$"},
    )
    url: str = Field(
        min_length=8,
        max_length=MAX_WEBHOOK_URL_CHARS,
        description="http:// or https:// URL the events are POSTed to",
    )
    events: list[WebhookEvent] = Field(min_length=1, max_length=len(WEBHOOK_EVENTS))
    namespace: NamespaceName = Field(
        DEFAULT_NAMESPACE,
        max_length=63,
        description=("whose events it receives"),
        json_schema_extra={"pattern": f"^{NAMESPACE.pattern}$"},
    )
    schedule_id: str | None = Field(
        None,
        description="only this schedule's events",
        json_schema_extra={"pattern": f"^{SLUG.pattern}$"},
    )
    secret: str | None = Field(
        None,
        min_length=16,
        max_length=256,
        description=(
            "the HMAC-SHA256 key signing each delivery; generated (and shown once, in the "
            "answer) when absent"
        ),
    )

    @field_validator("id", "schedule_id")
    @classmethod
    def _slug(cls, value: str | None) -> str | None:
        if value is not None and not SLUG.fullmatch(value):
            raise ValueError(
                "must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        parsed = urllib.parse.urlsplit(value)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError("url must be an http:// or https:// URL with a host")
        if any(c in value for c in " \r\n\t"):
            raise ValueError("url must not contain whitespace")
        return value

    @field_validator("events")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("each event at most once")
        return value


class Webhook(BaseModel):
    """A webhook as the API shows it: never its secret (but in the answer creating it)."""

    id: str
    url: str
    events: list[str]
    namespace: str
    schedule_id: str | None = None
    created_at: dt.datetime
    secret: str | None = Field(None, description="only in the answer that created it")


class WebhookList(BaseModel):
    items: list[Webhook]


class ScheduleList(BaseModel):
    items: list[Schedule]
    next: str | None = Field(None, description="pass as ?after= to get the next page")
    health: dict[str, ScheduleHealth] | None = Field(
        None, description="with ?health=true: each listed schedule's health, by id"
    )


class FireTime(BaseModel):
    nominal: dt.datetime
    fire_at: dt.datetime = Field(description="nominal plus the deterministic jitter")
    fire_id: str


class Preview(BaseModel):
    schedule_id: str
    times: list[FireTime]


def preview(schedule: Schedule, after: dt.datetime, count: int) -> Preview:
    trigger = schedule.compile()
    times = [
        FireTime(
            nominal=n,
            fire_at=n + triggers.jitter_offset(schedule.id, n, schedule.jitter),
            fire_id=triggers.fire_id(schedule.id, n),
        )
        for n in triggers.fire_times(trigger, after, limit=count)
    ]
    return Preview(schedule_id=schedule.id, times=times)
