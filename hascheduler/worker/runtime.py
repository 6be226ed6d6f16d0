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
import time
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
from ..runs import DEAD, RETRYING, SUCCEEDED, Claim, Outcome, RunLedger
from .app import Route, Run, WorkerApp, WorkerConfigError, load_app
from .delivery import Delivery, NotAFire, StaleFilter, read_delivery
from .metrics import WorkerMetrics
from .policy import RetryPolicy, RunTimeout, after_failure

log = structlog.get_logger("hascheduler.worker")

Clock = Callable[[], dt.datetime]

FETCH_WAIT_S = 0.5  # an idle fetch's wait: how promptly a stop is noticed
FETCH_COALESCE_S = 0.005  # at most this long for more free slots before a fetch
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


class Recorder:
    """Writes attempts' outcomes to the runs ledger behind the handlers: whatever ended
    while the previous write was in flight goes in the next one (no timer), so at high
    concurrency one write records many runs."""

    def __init__(self, runs: RunLedger, give_up_after_s: float) -> None:
        self.runs = runs
        self.give_up_after_s = give_up_after_s
        self._pending: list[tuple[Outcome, asyncio.Future[bool]]] = []
        self._wake = asyncio.Event()

    async def record(self, outcome: Outcome) -> bool:
        """Once written: True, or False when the claim was no longer this worker's."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.append((outcome, done))
        self._wake.set()
        return await done

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, []
            try:
                lost = await self._write([o for o, _ in batch])
            except PyMongoError as exc:
                for _, done in batch:
                    if not done.done():
                        done.set_exception(exc)
                continue
            for outcome, done in batch:
                if not done.done():
                    done.set_result(outcome.fire_id not in lost)

    async def _write(self, outcomes: list[Outcome]) -> set[str]:
        """Through a database failover, for as long as a run's lease: after that another
        worker may have taken the runs over anyway."""
        async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(PyMongoError),
                wait=wait_exponential_jitter(initial=0.1, max=2.0),
                stop=stop_after_delay(self.give_up_after_s), reraise=True):
            with attempt:
                return await self.runs.record(outcomes)
        raise AssertionError("unreachable: AsyncRetrying reraises")


class Worker:
    """Consumes fires and runs them, at most ``concurrency`` handlers at once."""

    def __init__(self, settings: WorkerSettings, runs: RunLedger, metrics: WorkerMetrics,
                 clock: Clock = lambda: dt.datetime.now(dt.UTC)) -> None:
        self.settings = settings
        self.app = settings.app
        self.runs = runs
        self.metrics = metrics
        self.clock = clock
        self.stale = StaleFilter()
        self.recorder = Recorder(runs, settings.ack_wait_s)
        self.tasks: set[asyncio.Task[None]] = set()
        self.running = 0  # handlers running now: what --concurrency bounds
        self._slot_freed = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        s = self.settings
        nc = await s.endpoint.connect(s.durable, max_reconnect_attempts=-1,
                                      reconnect_time_wait=0.5, disconnected_cb=_disconnected,
                                      reconnected_cb=_reconnected)
        recording = asyncio.create_task(self.recorder.run())
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
            recording.cancel()
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
        half = max(1, s.concurrency // 2)
        while not stop.is_set():
            if s.concurrency - self.running <= 0:
                await self._slots_freed(1, FETCH_WAIT_S)
                continue
            # Short runs free their slots one by one: waiting a moment for more makes one
            # fetch and one claim serve many fires instead of one each.
            await self._slots_freed(half, FETCH_COALESCE_S)
            free = s.concurrency - self.running
            try:
                messages = await subscription.fetch(free, timeout=FETCH_WAIT_S)
            except TimeoutError:  # an idle stream (nats-py's TimeoutError is one too)
                log.debug("fetch_idle")
                continue
            try:
                await self._start_runs(messages)
            except PyMongoError as exc:
                log.warning("run_claim_failed", count=len(messages), error=repr(exc)[:300])
                for message in messages:
                    with contextlib.suppress(*BROKER_ERRORS):
                        await message.nak(delay=LEDGER_DOWN_DELAY_S)

    async def _slots_freed(self, wanted: int, within_s: float) -> None:
        """Until ``wanted`` slots are free, or ``within_s`` passed."""
        deadline = time.monotonic() + within_s
        while self.settings.concurrency - self.running < wanted:
            self._slot_freed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._slot_freed.wait(), left)

    def _spawn(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _handler_done(self) -> None:
        self.running -= 1
        self._slot_freed.set()

    async def _drain(self) -> None:
        """Let the runs in flight finish within the drain bound; give the rest back."""
        if not self.tasks:
            return
        log.info("worker_draining", in_flight=self.running,
                 within_s=self.settings.drain_timeout_s)
        _, pending = await asyncio.wait(self.tasks, timeout=self.settings.drain_timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=10)
            log.warning("runs_given_back", count=len(pending))

    async def _start_runs(self, messages: list[Any]) -> None:
        """Read a fetched batch, claim its runs in one write, start the claimed ones."""
        received = self.clock()
        ready: list[tuple[Any, Delivery, Route]] = []
        for message in messages:
            picked = await self._screen(message, received)
            if picked is not None:
                ready.append((message, *picked))
        # The same fire twice in one batch: the first is claimed with the batch, the
        # second afterwards (it then finds the first's claim).
        first: dict[str, int] = {}
        for i, (_, delivery, _) in enumerate(ready):
            first.setdefault(delivery.fire.fire_id, i)
        batch = [ready[i] for i in sorted(first.values())]
        again = [r for i, r in enumerate(ready) if first[r[1].fire.fire_id] != i]
        claims = await self.runs.claim_many([d.fire for _, d, _ in batch],
                                            self.settings.worker_id, received,
                                            self.settings.ack_wait_s)
        for (message, delivery, route), claim in zip(batch, claims, strict=True):
            await self._claimed(message, delivery, route, claim)
        for message, delivery, route in again:
            claim = await self.runs.claim(delivery.fire, self.settings.worker_id,
                                          self.clock(), self.settings.ack_wait_s)
            await self._claimed(message, delivery, route, claim)

    async def _screen(self, message: Any, received: dt.datetime
                      ) -> tuple[Delivery, Route] | None:
        """The delivery and its route, or None once it is dealt with (not a fire, no
        handler, stale)."""
        try:
            delivery = read_delivery(message.subject, message.data)
        except NotAFire as exc:
            log.warning("fire_unreadable", subject=message.subject[:200], error=str(exc)[:200])
            await message.term()
            return None
        fire_id, target = delivery.fire.fire_id, delivery.fire.target
        route = self.app.route(target)
        if route is None:  # the consumer's filter and the routes disagree: never run
            log.warning("fire_without_handler", fire_id=fire_id, target=target)
            await message.term()
            return None
        if self.stale.is_stale(delivery, received):
            log.info("fire_stale_dropped", fire_id=fire_id, term=delivery.term)
            self.metrics.count(target, "stale")
            await message.ack()
            return None
        return delivery, route

    async def _claimed(self, message: Any, delivery: Delivery, route: Route,
                       claim: Claim) -> None:
        fire_id, target = delivery.fire.fire_id, delivery.fire.target
        if claim.claimed:
            if claim.took_over:
                log.warning("run_taken_over", fire_id=fire_id, from_worker=claim.took_over,
                            attempt=claim.attempt)
            self.running += 1
            self._spawn(self._attempt(message, delivery, route, claim.attempt))
        elif claim.outcome in (SUCCEEDED, DEAD):
            log.info("fire_duplicate_dropped", fire_id=fire_id, state=claim.outcome)
            self.metrics.count(target, "duplicate")
            await message.ack()
        else:  # running elsewhere, or waiting for its retry: back when it could be ours
            log.info("fire_busy", fire_id=fire_id, state=claim.outcome,
                     wait_s=round(claim.wait_s, 3))
            self.metrics.count(target, "busy")
            await message.nak(delay=claim.wait_s + BUSY_MARGIN_S)

    async def _attempt(self, message: Any, delivery: Delivery, route: Route,
                       attempt: int) -> None:
        try:
            outcome = await self._run_handler(message, delivery, route, attempt)
        finally:
            self._handler_done()
        try:
            await self._settle(message, outcome)
        except (PyMongoError, *BROKER_ERRORS) as exc:
            # Unrecorded or unacknowledged: the broker redelivers, and the run is claimed
            # again once its lease lapses.
            log.warning("run_settle_failed", fire_id=outcome.fire_id, error=repr(exc)[:300])

    async def _run_handler(self, message: Any, delivery: Delivery, route: Route,
                           attempt: int) -> Outcome:
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
            return Outcome(fire.fire_id, s.worker_id, attempt, started, finished, SUCCEEDED)
        verdict = after_failure(route.policy, attempt, error)
        if verdict.outcome == "retry":
            return Outcome(fire.fire_id, s.worker_id, attempt, started, finished, RETRYING,
                           verdict.error, verdict.delay_s)
        return Outcome(fire.fire_id, s.worker_id, attempt, started, finished, DEAD,
                       verdict.error)

    async def _settle(self, message: Any, outcome: Outcome) -> None:
        """Record the outcome, then tell the broker: ack, nak after the backoff (the broker
        does the waiting), or term."""
        if not await self.recorder.record(outcome):
            log.warning("run_lease_lost", fire_id=outcome.fire_id,
                        message="another worker took this run over; its outcome stands")
        target = _target_of(message)
        self.metrics.count(target, outcome.state)
        if outcome.state == SUCCEEDED:
            log.info("run_succeeded", fire_id=outcome.fire_id, attempt=outcome.attempt,
                     duration_s=round((outcome.finished - outcome.started).total_seconds(), 3))
            await message.ack()
        elif outcome.state == RETRYING:
            log.warning("run_failed", fire_id=outcome.fire_id, attempt=outcome.attempt,
                        error=(outcome.error or "")[:300],
                        retry_in_s=round(outcome.retry_in_s, 3))
            await message.nak(delay=outcome.retry_in_s)
        else:
            log.error("run_dead", fire_id=outcome.fire_id, attempt=outcome.attempt,
                      error=(outcome.error or "")[:300])
            await message.term()

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
