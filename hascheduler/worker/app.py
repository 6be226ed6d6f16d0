"""The worker's Python API: handlers registered per target pattern, each with its policy.

    from hascheduler.worker import PermanentFailure, RetryPolicy, Run, WorkerApp

    app = WorkerApp()

    @app.handler("reports.*", policy=RetryPolicy(max_attempts=3, timeout_s=120))
    async def send_report(run: Run) -> None:
        ...  # run.idempotency_key (the fire id) makes a repeated side effect detectable

Run it with ``hascheduler worker --app myjobs:app``. A synchronous handler runs in a thread
of its own, an async one on the worker's event loop.
"""

from __future__ import annotations

import datetime as dt
import importlib
import inspect
import os
import sys
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from hascheduler.core.constants import TARGET_PATTERN
from hascheduler.core.errors import ConfigError
from hascheduler.core.flow import ConcurrencyLimit, KeyTemplateError, RateLimit
from hascheduler.worker.policy import RetryPolicy

log = structlog.get_logger("hascheduler.worker")


_FIRST_USE = threading.Lock()


class LazyEvent(threading.Event):
    """A threading.Event whose Condition is made when first set or waited on.

    A worker makes one per run for a cancel that almost never comes, and a Condition (with
    its lock) is most of the cost of making an Event."""

    def __init__(self) -> None:  # no super().__init__(): it makes the Condition
        self._flag = False

    def __getattr__(self, name: str) -> Any:
        if name != "_cond":
            raise AttributeError(name)
        # Made once under a lock: a waiter and a setter racing to make it must share one.
        with _FIRST_USE:
            cond = self.__dict__.get("_cond")
            if cond is None:
                cond = self.__dict__["_cond"] = threading.Condition(threading.Lock())
        return cond


@dataclass(frozen=True, slots=True)
class Run:
    """What a handler is given: one attempt at one fire."""

    fire_id: str
    target: str
    schedule_id: str
    nominal_at: dt.datetime | None
    payload: Any
    attempt: int  # 1 for the first attempt
    worker_id: str
    event: Mapping[str, Any] = field(repr=False)  # the CloudEvent as delivered
    tenant: str | None = None  # a fan-out fire's tenant key (None for other fires)
    # Set when an operator cancels the run (POST /runs/{id}/cancel): an async handler is
    # cancelled outright; a synchronous one should look at cancel_requested and return.
    cancelled: threading.Event = field(default_factory=LazyEvent, repr=False, compare=False)

    @property
    def cancel_requested(self) -> bool:
        """An operator asked for this run to stop: return soon (it ends ``cancelled``)."""
        return self.cancelled.is_set()

    @property
    def idempotency_key(self) -> str:
        """The fire id: the same for every delivery and attempt of this fire, different for
        every other fire. A handler whose side effect must happen once keys it by this."""
        return self.fire_id


Handler = Callable[[Run], Awaitable[None] | None]


class WorkerConfigError(ConfigError):
    pass


@dataclass(frozen=True, slots=True)
class Route:
    pattern: str  # a target pattern: tokens, ``*`` for one, ``>`` (last) for the rest
    handler: Handler
    policy: RetryPolicy
    is_async: bool
    # At most ``limit`` runs of a rendered key at once, cluster-wide (core/flow.py); a
    # schedule's own ``concurrency`` overrides it for that schedule's runs.
    concurrency: ConcurrencyLimit | None = None
    rate: RateLimit | None = None  # at most so many starts per period of a rendered key

    def matches(self, target: str) -> bool:
        return pattern_matches(self.pattern, target)


def pattern_matches(pattern: str, target: str) -> bool:
    want, have = pattern.split("."), target.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


def check_pattern(pattern: str) -> None:
    """Raises WorkerConfigError for a pattern no target could match as meant."""
    tokens = pattern.split(".")
    plain = ".".join("x" if t in {"*", ">"} else t for t in tokens)
    if ">" in tokens[:-1] or not TARGET_PATTERN.fullmatch(plain):
        raise WorkerConfigError(
            f"target pattern {pattern!r}: dot-separated tokens of letters, "
            "digits, _ and -, where * stands for one token and a last >"
            " for the rest"
        )


# The label every schedule an app declares carries: its name, so that applying the app's
# declarations prunes only its own schedules.
APP_LABEL = "app"
ROUTED_TARGETS = 4096  # targets whose route is remembered (then forgotten all at once)


class WorkerApp:
    """Handlers by target pattern; the first pattern registered that matches a target
    handles it. ``name`` is needed to declare schedules (``schedule``, ``schedules``):
    they carry it as their ``app`` label, and applying them prunes by it."""

    def __init__(self, policy: RetryPolicy | None = None, name: str | None = None) -> None:
        self.default_policy = policy or RetryPolicy()
        self.routes: list[Route] = []
        self.name = name
        self._declared: dict[str, dict[str, Any]] = {}
        # Each fire's target matched against every pattern was a few percent of a busy
        # worker's CPU; targets are few. Bounded: targets come from the broker.
        self._routed: dict[str, Route | None] = {}

    def add(
        self,
        pattern: str,
        handler: Handler,
        policy: RetryPolicy | None = None,
        concurrency: Mapping[str, Any] | None = None,
        rate: Mapping[str, Any] | None = None,
    ) -> None:
        """``concurrency``: ``{"key": <template>, "limit": N}``; ``rate``: ``{"key":
        <template>, "limit": N, "per": "PT1S"}`` (docs/WORKERS.md)."""
        check_pattern(pattern)
        if not callable(handler):
            raise WorkerConfigError(f"the handler for {pattern!r} is not callable")
        try:
            limit = None if concurrency is None else ConcurrencyLimit.of(concurrency)
            paced = None if rate is None else RateLimit.of(rate)
        except KeyTemplateError as exc:
            raise WorkerConfigError(f"the handler for {pattern!r}: {exc}") from None
        self.routes.append(
            Route(
                pattern,
                handler,
                policy or self.default_policy,
                inspect.iscoroutinefunction(handler),
                limit,
                paced,
            )
        )
        self._routed.clear()

    def handler(
        self,
        pattern: str,
        *,
        policy: RetryPolicy | None = None,
        concurrency: Mapping[str, Any] | None = None,
        rate: Mapping[str, Any] | None = None,
    ) -> Callable[[Handler], Handler]:
        def register(function: Handler) -> Handler:
            self.add(pattern, function, policy, concurrency, rate)
            return function

        return register

    def schedule(
        self,
        id: str,
        *,
        cron: str | None = None,
        every: float | str | None = None,
        at: list[str] | None = None,
        timezone: str | None = None,
        target: str | None = None,
        **fields: Any,
    ) -> Callable[[Handler], Handler]:
        """Declare the schedule that feeds a handler: put it above ``@app.handler(...)``;
        its target is the handler's pattern unless given (a pattern with wildcards needs
        one). ``fields`` are any other schedule fields (``payload``, ``jitter``, ...)."""
        triggers = [t for t in (cron, every, at) if t is not None]
        if len(triggers) != 1:
            raise WorkerConfigError(f"schedule {id!r}: give one of cron=, every= or at=")
        trigger: dict[str, Any]
        if cron is not None:
            trigger = {"kind": "cron", "cron": cron, "timezone": timezone or "UTC"}
        elif every is not None:
            trigger = {"kind": "interval", "every": every}
        else:
            trigger = {"kind": "at", "at": at}

        def declare(function: Handler) -> Handler:
            pattern = next((r.pattern for r in self.routes if r.handler is function), None)
            chosen = target or pattern
            if chosen is None or "*" in chosen.split(".") or ">" in chosen.split("."):
                raise WorkerConfigError(
                    f"schedule {id!r}: name its target= (put @app.schedule above "
                    "@app.handler, whose pattern is the target when it has no wildcard)"
                )
            self.schedules(
                [
                    {
                        "id": id,
                        "name": fields.pop("name", id),
                        "target": chosen,
                        "trigger": trigger,
                        **fields,
                    }
                ]
            )
            return function

        return declare

    def schedules(self, declarations: list[Mapping[str, Any]]) -> None:
        """Declare schedules, each as ``PUT /schedules/{id}`` takes it with its ``id``."""
        for declaration in declarations:
            schedule_id = declaration.get("id")
            if not isinstance(schedule_id, str) or schedule_id in self._declared:
                raise WorkerConfigError(
                    f"schedule {schedule_id!r}: each declaration needs an id of its own"
                )
            self._declared[schedule_id] = dict(declaration)

    def declarations(self) -> list[dict[str, Any]]:
        """The declared schedules, each carrying the app's label."""
        if self._declared and not self.name:
            raise WorkerConfigError(
                "an app that declares schedules needs a name: WorkerApp(name=...)"
            )
        return [
            {**d, "labels": {**d.get("labels", {}), APP_LABEL: self.name}}
            for d in self._declared.values()
        ]

    def route(self, target: str) -> Route | None:
        try:
            return self._routed[target]
        except KeyError:
            pass
        if len(self._routed) >= ROUTED_TARGETS:
            self._routed.clear()
        found = self._routed[target] = next((r for r in self.routes if r.matches(target)), None)
        return found

    @property
    def patterns(self) -> list[str]:
        return list(dict.fromkeys(r.pattern for r in self.routes))


def log_run(run: Run) -> None:
    """The handler when none is named: log each fire."""
    log.info(
        "fire_received",
        fire_id=run.fire_id,
        attempt=run.attempt,
        term=run.event.get("data", {}).get("term"),
        nominal_at=run.nominal_at.isoformat() if run.nominal_at else None,
        payload=run.payload,
    )


def _import(spec: str, flag: str) -> Any:
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise WorkerConfigError(f"{flag} {spec!r}: write it as module:attribute")
    # A module of the directory the command runs in is found, as `python -m` finds it
    # (an installed console script's path starts at its own directory).
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise WorkerConfigError(f"{flag} {spec!r}: {exc}") from None


def load_app(
    app: str | None, handler: str | None, target: str | None, policy: RetryPolicy | None = None
) -> WorkerApp:
    """The app ``--app module:attribute`` names, or one routing ``target`` (default every
    target) to ``--handler module:function`` (default: log it). Raises WorkerConfigError
    naming the flag."""
    if app:
        if handler:
            raise WorkerConfigError(
                "--app and --handler do not go together: register the handler in the app"
            )
        found = _import(app, "--app")
        if not isinstance(found, WorkerApp):
            raise WorkerConfigError(
                f"--app {app!r} is a {type(found).__name__}, not a hascheduler.worker.WorkerApp"
            )
        if not found.routes:
            raise WorkerConfigError(f"--app {app!r} has no handler registered")
        return found
    function = _import(handler, "--handler") if handler else log_run
    one = WorkerApp(policy)
    one.add(target or ">", function)
    return one
