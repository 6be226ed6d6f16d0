"""``hascheduler worker``: a durable JetStream consumer that runs each fire to an outcome.

For each delivered fire: read it (a message that is not a fire is terminated), drop it if
stale (delivery.StaleFilter), claim its run in the runs ledger (a fire already running
elsewhere comes back when that claim could lapse; one already finished is acknowledged),
then run the handler with heartbeats to the broker (``in_progress``: not redelivered while
alive) and to the ledger (``lease_until``). The outcome decides the acknowledgement:
succeeded -> ack; a failure with attempts left -> ``nak`` with the backoff as the delay
(the broker does the waiting, no timer here); dead -> ``term``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats
import structlog
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from pymongo import AsyncMongoClient, uri_parser
from pymongo.errors import ConfigurationError, InvalidURI, PyMongoError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential_jitter,
)

from .. import logs
from ..brokers.base import SUBJECT_PREFIX
from ..brokers.nats import NatsEndpoint, ensure_stream
from ..constants import DEFAULT_DATABASE, DEFAULT_RUN_RETENTION_S, RUNS
from ..runs import DEAD, SUCCEEDED, RunLedger
from .app import Route, Run, WorkerApp, WorkerConfigError, load_app
from .delivery import Delivery, NotAFire, StaleFilter, read_delivery
from .metrics import WorkerMetrics
from .policy import RetryPolicy, RunTimeout, after_failure

log = structlog.get_logger("hascheduler.worker")

Clock = Callable[[], dt.datetime]

FETCH_WAIT_S = 0.5  # an idle fetch's wait: how promptly a stop is noticed
# A fire running elsewhere is offered again once that claim could have lapsed, plus this.
BUSY_MARGIN_S = 0.5
# The ledger may be unreachable (a failover): a claim is retried by the broker after this.
LEDGER_DOWN_DELAY_S = 2.0

# What the broker may throw at a consumer; TimeoutError is also what nats-py raises when a
# request gets no answer in time.
BROKER_ERRORS = (nats.errors.Error, OSError, TimeoutError)


@dataclass(frozen=True)
class WorkerSettings:
    endpoint: NatsEndpoint
    mongodb_uri: str
    app: WorkerApp
    durable: str
    worker_id: str
    concurrency: int = 8
    # The broker redelivers an unacknowledged fire after this; the ledger's run lease is as
    # long, and both are renewed every third of it while the handler runs.
    ack_wait_s: float = 30.0
    drain_timeout_s: float = 30.0
    run_retention_s: float = DEFAULT_RUN_RETENTION_S
    metrics_port: int | None = None

    @classmethod
    def parse(cls, *, broker: str | None, mongodb_uri: str | None, app: str | None,
              handler: str | None, target: str | None, durable: str | None,
              worker_id: str | None, concurrency: int, ack_wait_s: float,
              drain_timeout_s: float, run_retention_s: float, metrics_port: int | None,
              policy: RetryPolicy) -> WorkerSettings:
        """The worker's flags as values, once. Raises WorkerConfigError naming the flag."""
        if not broker or not broker.startswith(("nats://", "tls://")):
            raise WorkerConfigError("--broker (or HASCHEDULER_BROKER) must be a nats:// URL")
        try:
            endpoint = NatsEndpoint.parse(broker)
        except ValueError as exc:
            raise WorkerConfigError(f"--broker: {exc}") from None
        if not mongodb_uri:
            raise WorkerConfigError("--mongodb-uri (or HASCHEDULER_MONGODB_URI) is required: "
                                    "the runs ledger lives there")
        try:
            uri_parser.parse_uri(mongodb_uri)
        except (InvalidURI, ValueError, ConfigurationError) as exc:
            raise WorkerConfigError(f"--mongodb-uri: {exc}") from None
        if app and target:
            raise WorkerConfigError("--target goes with --handler; an --app's handlers name "
                                    "their targets")
        loaded = load_app(app, handler, target, policy)
        name = durable or "worker-" + "".join(
            c if c.isalnum() else "-" for c in "_".join(loaded.patterns))[:200]
        if ack_wait_s < 1:
            raise WorkerConfigError("--ack-wait must be at least 1 second")
        return cls(endpoint, mongodb_uri, loaded, name,
                   worker_id or f"{socket.gethostname()}-{os.getpid()}",
                   concurrency=concurrency, ack_wait_s=ack_wait_s,
                   drain_timeout_s=drain_timeout_s, run_retention_s=run_retention_s,
                   metrics_port=metrics_port)


async def run_worker(settings: WorkerSettings) -> int:
    """Run until SIGTERM or SIGINT, then drain within ``drain_timeout_s``."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    logs.identify(settings.worker_id)
    metrics = WorkerMetrics()
    if settings.metrics_port is not None:
        metrics.serve(settings.metrics_port)
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        settings.mongodb_uri, tz_aware=True, appname=f"hascheduler-worker/{settings.worker_id}",
        serverSelectionTimeoutMS=5000)
    try:
        runs = RunLedger(client.get_default_database(DEFAULT_DATABASE)[RUNS])
        await _until_up("creating the runs ledger's indexes",
                        lambda: runs.ensure_indexes(settings.run_retention_s), stop)
        await Worker(settings, runs, metrics).run(stop)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 5)
    log.info("worker_stopped")
    return 0


async def _until_up(what: str, work: Callable[[], Any], stop: asyncio.Event) -> None:
    async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(PyMongoError),
            wait=wait_exponential_jitter(initial=0.2, max=5.0),
            before_sleep=lambda state: log.warning(
                "database_unreachable", during=what,
                error=repr(state.outcome.exception() if state.outcome else None))):
        with attempt:
            if stop.is_set():
                return
            await work()


class Worker:
    """Consumes fires and runs them, at most ``concurrency`` at once."""

    def __init__(self, settings: WorkerSettings, runs: RunLedger, metrics: WorkerMetrics,
                 clock: Clock = lambda: dt.datetime.now(dt.UTC)) -> None:
        self.settings = settings
        self.app = settings.app
        self.runs = runs
        self.metrics = metrics
        self.clock = clock
        self.stale = StaleFilter()
        self.inflight: set[asyncio.Task[None]] = set()
        self._slot_freed = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        s = self.settings
        nc = await s.endpoint.connect(s.durable, max_reconnect_attempts=-1,
                                      reconnect_time_wait=0.5, disconnected_cb=_disconnected,
                                      reconnected_cb=_reconnected)
        log.info("worker_started", patterns=self.app.patterns, durable=s.durable,
                 concurrency=s.concurrency)
        print(f"worker {s.worker_id} consuming {', '.join(self.app.patterns)} as {s.durable}",
              flush=True)
        try:
            # A broker hiccup (a restart, a lost consumer, a request timing out) ends one
            # subscription, never the worker: subscribe again after a capped, jittered wait.
            async for attempt in AsyncRetrying(
                    retry=retry_if_exception_type(BROKER_ERRORS),
                    wait=wait_exponential_jitter(initial=0.2, max=5.0),
                    before_sleep=_log_resubscribe, reraise=True):
                with attempt:
                    await self._consume(nc, stop)
            await self._drain()
        finally:
            # Every message is acknowledged explicitly, so nothing is left to drain from
            # the connection; drain() on a pull subscription can wait forever.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 5)

    async def _consume(self, nc: Any, stop: asyncio.Event) -> None:
        """Subscribe (creating the stream and the durable consumer if they are gone) and
        start runs until ``stop``."""
        s = self.settings
        js = nc.jetstream()
        await ensure_stream(js, s.endpoint.stream, s.endpoint.dedup_window_s)
        subjects = [f"{SUBJECT_PREFIX}.{p}" for p in self.app.patterns]
        await js.add_consumer(s.endpoint.stream, ConsumerConfig(
            durable_name=s.durable, ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL, ack_wait=s.ack_wait_s, max_deliver=-1,
            max_ack_pending=max(1000, 4 * s.concurrency),
            **({"filter_subject": subjects[0]} if len(subjects) == 1
               else {"filter_subjects": subjects})))
        subscription = await js.pull_subscribe_bind(durable=s.durable, stream=s.endpoint.stream)
        while not stop.is_set():
            free = s.concurrency - len(self.inflight)
            if free <= 0:
                self._slot_freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._slot_freed.wait(), FETCH_WAIT_S)
                continue
            try:
                messages = await subscription.fetch(free, timeout=FETCH_WAIT_S)
            except TimeoutError:  # an idle stream (nats-py's TimeoutError is one too)
                log.debug("fetch_idle")
                continue
            for message in messages:
                task = asyncio.create_task(self._process(message))
                self.inflight.add(task)
                task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self.inflight.discard(task)
        self._slot_freed.set()

    async def _drain(self) -> None:
        """Let the runs in flight finish within the drain bound; give the rest back."""
        if not self.inflight:
            return
        log.info("worker_draining", in_flight=len(self.inflight),
                 within_s=self.settings.drain_timeout_s)
        _, pending = await asyncio.wait(self.inflight, timeout=self.settings.drain_timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=10)
            log.warning("runs_given_back", count=len(pending))

    async def _process(self, message: Any) -> None:
        try:
            await self._process_one(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broker or ledger failure: the broker redelivers
            log.warning("run_handling_failed", subject=message.subject, error=repr(exc))

    async def _process_one(self, message: Any) -> None:
        s = self.settings
        received = self.clock()
        try:
            delivery = read_delivery(message.subject, message.data)
        except NotAFire as exc:
            log.warning("fire_unreadable", subject=message.subject[:200], error=str(exc)[:200])
            await message.term()
            return
        fire_id, target = delivery.fire.fire_id, delivery.fire.target
        route = self.app.route(target)
        if route is None:  # the consumer's filter and the routes disagree: never run
            log.warning("fire_without_handler", fire_id=fire_id, target=target)
            await message.term()
            return
        if self.stale.is_stale(delivery, received):
            log.info("fire_stale_dropped", fire_id=fire_id, term=delivery.term)
            self.metrics.count(target, "stale")
            await message.ack()
            return
        try:
            claim = await self.runs.claim(delivery.fire, s.worker_id, received, s.ack_wait_s)
        except PyMongoError as exc:
            log.warning("run_claim_failed", fire_id=fire_id, error=repr(exc)[:300])
            await message.nak(delay=LEDGER_DOWN_DELAY_S)
            return
        if not claim.claimed:
            if claim.outcome in (SUCCEEDED, DEAD):
                log.info("fire_duplicate_dropped", fire_id=fire_id, state=claim.outcome)
                self.metrics.count(target, "duplicate")
                await message.ack()
            else:  # running elsewhere, or waiting for its retry: back when it could be ours
                log.info("fire_busy", fire_id=fire_id, state=claim.outcome,
                         wait_s=round(claim.wait_s, 3))
                self.metrics.count(target, "busy")
                await message.nak(delay=claim.wait_s + BUSY_MARGIN_S)
            return
        if claim.took_over:
            log.warning("run_taken_over", fire_id=fire_id, from_worker=claim.took_over,
                        attempt=claim.attempt)
        await self._attempt(message, delivery, route, claim.attempt)

    async def _attempt(self, message: Any, delivery: Delivery, route: Route,
                       attempt: int) -> None:
        s = self.settings
        fire = delivery.fire
        run = Run(fire_id=fire.fire_id, target=fire.target, schedule_id=fire.schedule_id,
                  nominal_at=fire.nominal_at, payload=delivery.payload, attempt=attempt,
                  worker_id=s.worker_id, event=fire.event)
        started = self.clock()
        log.debug("run_started", fire_id=fire.fire_id, attempt=attempt)
        heartbeat = asyncio.create_task(self._heartbeat(message, fire.fire_id, attempt))
        error: BaseException | None = None
        with self.metrics.in_flight(fire.target):
            try:
                async with asyncio.timeout(route.policy.timeout_s) as limit:
                    await _call(route, run)
            except TimeoutError as exc:
                error = (RunTimeout(f"the run took longer than {route.policy.timeout_s:g} s")
                         if limit.expired() else exc)
            except asyncio.CancelledError:
                # The drain ran out: give the run back for another worker, right away.
                await asyncio.shield(self._give_back(message, fire.fire_id, attempt))
                raise
            except Exception as exc:
                error = exc
            finally:
                heartbeat.cancel()
        finished = self.clock()
        self.metrics.duration(fire.target, (finished - started).total_seconds())
        if error is None:
            await self._record(lambda: self.runs.succeed(fire.fire_id, s.worker_id, attempt,
                                                         started, finished), fire.fire_id)
            self.metrics.count(fire.target, SUCCEEDED)
            log.info("run_succeeded", fire_id=fire.fire_id, attempt=attempt,
                     duration_s=round((finished - started).total_seconds(), 3))
            await message.ack()
            return
        verdict = after_failure(route.policy, attempt, error)
        if verdict.outcome == "retry":
            await self._record(lambda: self.runs.retry_later(
                fire.fire_id, s.worker_id, attempt, started, finished, verdict.error,
                verdict.delay_s), fire.fire_id)
            self.metrics.count(fire.target, "retrying")
            log.warning("run_failed", fire_id=fire.fire_id, attempt=attempt,
                        error=verdict.error[:300], retry_in_s=round(verdict.delay_s, 3))
            await message.nak(delay=verdict.delay_s)
            return
        await self._record(lambda: self.runs.die(fire.fire_id, s.worker_id, attempt, started,
                                                 finished, verdict.error), fire.fire_id)
        self.metrics.count(fire.target, DEAD)
        log.error("run_dead", fire_id=fire.fire_id, attempt=attempt, error=verdict.error[:300])
        await message.term()

    async def _record(self, write: Callable[[], Any], fire_id: str) -> None:
        """An attempt's outcome, written through a database failover (for as long as the
        run's lease: after that another worker may have taken it over anyway)."""
        async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(PyMongoError),
                wait=wait_exponential_jitter(initial=0.1, max=2.0),
                stop=stop_after_delay(self.settings.ack_wait_s), reraise=True):
            with attempt:
                if not await write():
                    log.warning("run_lease_lost", fire_id=fire_id,
                                message="another worker took this run over; its outcome "
                                        "stands")

    async def _heartbeat(self, message: Any, fire_id: str, attempt: int) -> None:
        s = self.settings
        while True:
            await asyncio.sleep(s.ack_wait_s / 3)
            with contextlib.suppress(*BROKER_ERRORS):
                await message.in_progress()
            try:
                if not await self.runs.heartbeat(fire_id, s.worker_id, attempt, self.clock(),
                                                 s.ack_wait_s):
                    log.warning("run_lease_lost", fire_id=fire_id)
                    return
            except PyMongoError as exc:
                log.warning("run_heartbeat_failed", fire_id=fire_id, error=repr(exc)[:300])

    async def _give_back(self, message: Any, fire_id: str, attempt: int) -> None:
        with contextlib.suppress(PyMongoError, *BROKER_ERRORS):
            await self.runs.release(fire_id, self.settings.worker_id, attempt, self.clock(),
                                    "the worker stopped before the run finished")
            await message.nak()
        self.metrics.count(_target_of(message), "released")


def _target_of(message: Any) -> str:
    return str(message.subject).removeprefix(SUBJECT_PREFIX + ".")


async def _call(route: Route, run: Run) -> None:
    if route.is_async:
        await route.handler(run)  # type: ignore[misc]
        return
    # A thread of its own, a daemon: a synchronous handler cannot be interrupted, and one
    # that outlives its timeout or the drain must not hold the process at exit.
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if not done.done():
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

    def body() -> None:
        try:
            result = route.handler(run)
            if result is not None and hasattr(result, "__await__"):
                raise TypeError("a synchronous handler returned an awaitable")
        except BaseException as exc:  # handed to the loop, raised there
            loop.call_soon_threadsafe(settle, exc)
        else:
            loop.call_soon_threadsafe(settle, None)

    threading.Thread(target=body, name=f"run {run.fire_id}"[:60], daemon=True).start()
    await done


async def _disconnected() -> None:
    log.warning("broker_disconnected")


async def _reconnected() -> None:
    log.info("broker_reconnected")


def _log_resubscribe(state: RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome else None
    log.warning("worker_resubscribing", error=repr(error), attempt=state.attempt_number)
