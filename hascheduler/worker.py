"""``hascheduler worker``: a durable JetStream consumer that runs each fire once.

It drops a fire id it has already handled (the broker may redeliver, a new leader may
republish), and a *stale* fire: one from a term older than a term it has already seen,
whose nominal time is later than the moment it first saw that newer term. Such a fire can
only come from a deposed leader acting after a newer one started; a fire an old leader
claimed in time always has an earlier nominal time, so it is still run (its republish by
the new leader would be deduplicated away by the broker, so dropping it would lose it).
A fire is acknowledged after its handler returns; a handler that raises gets it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import importlib
import inspect
import json
import signal
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats
import structlog
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential_jitter

from .brokers.base import SUBJECT_PREFIX
from .brokers.nats import NatsEndpoint, ensure_stream
from .errors import ConfigError

log = structlog.get_logger("hascheduler.worker")

Handler = Callable[[dict[str, Any]], Awaitable[None] | None]
SEEN_FIRES = 100_000  # fire ids remembered for deduplication


class WorkerConfigError(ConfigError):
    pass


def load_handler(spec: str | None) -> Handler:
    if not spec:
        return log_fire
    module_name, sep, function = spec.partition(":")
    if not sep:
        raise WorkerConfigError(f"--handler {spec!r}: write it as module:function")
    try:
        handler = getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as exc:
        raise WorkerConfigError(f"--handler {spec!r}: {exc}") from None
    if not callable(handler):
        raise WorkerConfigError(f"--handler {spec!r} is not callable")
    return handler  # type: ignore[no-any-return]


def log_fire(event: dict[str, Any]) -> None:
    data = event.get("data", {})
    log.info("fire_received", fire_id=event.get("id"), term=data.get("term"),
             nominal_at=data.get("nominal_at"), payload=data.get("payload"))


class FireFilter:
    """Decides, per delivered fire, whether to run it (pure: no I/O)."""

    def __init__(self, capacity: int = SEEN_FIRES) -> None:
        self.capacity = capacity
        self.seen: OrderedDict[str, None] = OrderedDict()
        self.first_seen_term: dict[int, dt.datetime] = {}
        self.max_term = 0

    def verdict(self, event: dict[str, Any], received_at: dt.datetime) -> str:
        """``run``, ``duplicate`` or ``stale``. Raises ValueError, TypeError, KeyError or
        AttributeError for an event that is not a fire (no string id, no integer term, no
        ISO-8601 nominal time)."""
        fire_id = event["id"]
        data = event["data"]
        term = data["term"]
        if not isinstance(fire_id, str) or not isinstance(term, int) or isinstance(term, bool):
            raise TypeError("a fire has a string id and an integer term")
        nominal = dt.datetime.fromisoformat(data["nominal_at"].replace("Z", "+00:00"))
        if fire_id in self.seen:
            return "duplicate"
        if term < self.max_term:
            newer_since = min(t for k, t in self.first_seen_term.items() if k > term)
            if nominal > newer_since:
                return "stale"
        if term not in self.first_seen_term:
            self.first_seen_term[term] = received_at
        self.max_term = max(self.max_term, term)
        return "run"

    def done(self, event: dict[str, Any]) -> None:
        self.seen[str(event.get("id"))] = None
        if len(self.seen) > self.capacity:
            self.seen.popitem(last=False)


@dataclass(frozen=True)
class WorkerSettings:
    endpoint: NatsEndpoint
    target: str  # a subject suffix; wildcards * and > allowed
    handler: str | None  # module:function, checked importable; None logs each fire
    durable: str

    @classmethod
    def parse(cls, broker: str | None, target: str | None, handler: str | None,
              durable: str | None) -> WorkerSettings:
        """The worker's flags as values, once. Raises WorkerConfigError naming the flag."""
        if not broker or not broker.startswith(("nats://", "tls://")):
            raise WorkerConfigError("--broker (or HASCHEDULER_BROKER) must be a nats:// URL")
        try:
            endpoint = NatsEndpoint.parse(broker)
        except ValueError as exc:
            raise WorkerConfigError(f"--broker: {exc}") from None
        if not target:
            raise WorkerConfigError("--target (or HASCHEDULER_WORKER_TARGET) is required")
        load_handler(handler)
        name = durable or "worker-" + "".join(c if c.isalnum() else "-" for c in target)
        return cls(endpoint, target, handler, name)


async def run_worker(settings: WorkerSettings) -> int:
    endpoint, target, name = settings.endpoint, settings.target, settings.durable
    handler = load_handler(settings.handler)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    nc = await endpoint.connect(name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                disconnected_cb=_disconnected, reconnected_cb=_reconnected)
    fires = FireFilter()
    log.info("worker_started", target=target, durable=name)
    print(f"worker {name} consuming {SUBJECT_PREFIX}.{target}", flush=True)
    try:
        # A broker hiccup (a restart, a lost consumer, a request timing out) ends one
        # subscription, never the worker: subscribe again after a capped, jittered wait.
        async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(BROKER_ERRORS),
                wait=wait_exponential_jitter(initial=0.2, max=5.0),
                before_sleep=_log_retry, reraise=True):
            with attempt:
                await _consume(nc, endpoint, target, name, stop, fires, handler)
    finally:
        # Every message is acknowledged explicitly, so there is nothing to drain; drain()
        # on a pull subscription can wait forever.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 5)
    log.info("worker_stopped")
    return 0


# What the broker may throw at a consumer; TimeoutError is also what nats-py raises when a
# request gets no answer in time.
BROKER_ERRORS = (nats.errors.Error, OSError, TimeoutError)


async def _disconnected() -> None:
    log.warning("broker_disconnected")


async def _reconnected() -> None:
    log.info("broker_reconnected")


def _log_retry(state: RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome else None
    log.warning("worker_resubscribing", error=repr(error), attempt=state.attempt_number)


async def _consume(nc: Any, endpoint: NatsEndpoint, target: str, name: str,
                   stop: asyncio.Event, fires: FireFilter, handler: Handler) -> None:
    """Subscribe (creating the stream and the durable consumer if they are gone) and run
    fires until ``stop``."""
    js = nc.jetstream()
    await ensure_stream(js, endpoint.stream, endpoint.dedup_window_s)
    subscription = await js.pull_subscribe(
        f"{SUBJECT_PREFIX}.{target}", durable=name, stream=endpoint.stream,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                              ack_wait=30))
    while not stop.is_set():
        try:
            messages = await subscription.fetch(100, timeout=0.5)
        except TimeoutError:  # an idle stream (nats-py's TimeoutError is one too)
            log.debug("fetch_idle")
            continue
        for message in messages:
            await _handle(message, fires, handler)


async def _handle(message: Any, fires: FireFilter, handler: Handler) -> None:
    try:
        event = json.loads(message.data)
        verdict = fires.verdict(event, dt.datetime.now(dt.UTC))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        # Not a fire of ours (hand-published, truncated, another producer's): never
        # redelivered, never fatal.
        log.warning("fire_unreadable", subject=message.subject, error=repr(exc)[:200])
        await message.term()
        return
    if verdict != "run":
        log.info(f"fire_{verdict}_dropped", fire_id=event.get("id"),
                 term=event.get("data", {}).get("term"))
        await message.ack()
        return
    try:
        result = handler(event)
        if inspect.isawaitable(result):
            await result
    except Exception as exc:
        log.warning("handler_failed", fire_id=event.get("id"), error=repr(exc))
        await message.nak(delay=1.0)
        return
    fires.done(event)
    await message.ack()
