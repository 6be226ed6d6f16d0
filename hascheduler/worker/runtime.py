"""``hascheduler worker``: a durable consumer (JetStream or RabbitMQ, a FireConsumer) that
runs each fire to an outcome.

A fetch loop claims the runs of a whole fetch in one write (worker/claiming.py: fetching
and claiming); here, the running and answering: claimed runs wait in a queue for one of
``--concurrency`` runners. One heartbeat, every third of the ack wait, tells the broker
each held message is in progress (not redelivered while this worker lives) and extends
every claim's ledger lease in one write. A runner's outcome is written behind it (the
Recorder, many outcomes per write), then decides the answer to the broker: succeeded ->
ack; a failure with attempts left -> ``nak`` with the backoff as the delay (the broker does
the waiting, no timer here); dead or cancelled -> ``term``. While it holds runs, the worker
asks every CANCEL_POLL_S which of them an operator cancelled: an async handler is
cancelled, a synchronous one sees ``run.cancel_requested``; the run ends ``cancelled``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import time
from typing import Any

import structlog
from pymongo.errors import PyMongoError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    wait_exponential_jitter,
)

from hascheduler.brokers.base import FireConsumer
from hascheduler.core.clock import Clock
from hascheduler.core.flow import rank
from hascheduler.core.run_states import (
    CANCELLED,
    DEAD,
    RETRYING,
    SUCCEEDED,
)
from hascheduler.process import lifecycle
from hascheduler.process.lifecycle import Every
from hascheduler.storage.run_records import FireRef, Outcome
from hascheduler.storage.runs import RunLedger
from hascheduler.storage.schedules import ScheduleStore
from hascheduler.worker.attempts import Attempts
from hascheduler.worker.claiming import Claimer, Fetcher
from hascheduler.worker.flow import (
    LAPSED_SWEEP_S,
    FlowGate,
    RateWaker,
)
from hascheduler.worker.held import Held
from hascheduler.worker.metrics import WorkerMetrics
from hascheduler.worker.recorder import Recorder
from hascheduler.worker.settings import WorkerSettings

log = structlog.get_logger("hascheduler.worker")

# How often a worker holding runs asks which were cancelled: a cancel takes effect within
# this plus a round trip (under the promised second).
CANCEL_POLL_S = 0.5


class Worker:
    """Consumes fires and runs them: a fetch loop claims runs in batches and queues them;
    ``concurrency`` runners take them one at a time; one heartbeat renews every claim."""

    def __init__(
        self,
        settings: WorkerSettings,
        runs: RunLedger,
        metrics: WorkerMetrics,
        clock: Clock = lambda: dt.datetime.now(dt.UTC),
        schedules: ScheduleStore | None = None,
        flow: FlowGate | None = None,
    ) -> None:
        self.settings = settings
        self.broker_errors = settings.broker.kind.errors()
        self.schedules = schedules
        self.flow = flow
        self.runs = runs
        self.metrics = metrics
        self.clock = clock
        self.recorder = Recorder(runs, settings.ack_wait_s, self._answer, self._ended)
        self.attempts = Attempts(settings.worker_id, clock, metrics, self._give_back)
        self.held: dict[str, Held] = {}
        # Claimed runs waiting for a runner, by rank: priority, aged (core/flow.rank).
        self.queue: asyncio.PriorityQueue[tuple[float, int, Held]] = asyncio.PriorityQueue()
        self._queued = itertools.count()
        self._released = asyncio.Event()
        self.fetcher = Fetcher(
            settings, Claimer(settings, runs, metrics, clock, flow, self.hold), self
        )

    def holding(self) -> int:
        return len(self.held)

    def hold(self, held: Held) -> None:
        """A claimed run, queued for a runner."""
        self.held[held.delivery.fire.fire_id] = held
        self.queue.put_nowait(
            (rank(held.delivery.priority, time.monotonic()), next(self._queued), held)
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop``, then drain. Its parts live on one exit stack, unwound
        in reverse: the runners, the cancel watch, the heartbeat, the recorder (which
        writes the outcomes it holds first), the broker connection."""
        s = self.settings
        consumer = self.consumer()
        async with contextlib.AsyncExitStack() as stack:
            await consumer.connect(s.durable)
            stack.push_async_callback(lifecycle.bounded, "broker connection", consumer.close)
            lifecycle.start(stack, "runs recorder", self.recorder, patient=True)
            lifecycle.start(stack, "run heartbeat", Every(s.ack_wait_s / 3, self._heartbeat))
            lifecycle.start(stack, "cancel watch", Every(CANCEL_POLL_S, self._watch_cancels))
            if self.flow is not None:
                stack.push_async_callback(self.flow.close)
                lifecycle.start(
                    stack, "lapsed slot sweep", Every(LAPSED_SWEEP_S, self._sweep_slots)
                )
                lifecycle.start(stack, "rate waker", RateWaker(self.flow))
            runners = [asyncio.create_task(self._runner()) for _ in range(s.concurrency)]
            stack.push_async_callback(_cancelled, runners)
            log.info(
                "worker_started",
                patterns=s.app.patterns,
                durable=s.durable,
                concurrency=s.concurrency,
            )
            # A broker hiccup (a restart, a lost consumer, a request timing out) ends one
            # subscription, never the worker: subscribe again after a capped, jittered wait.
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(self.broker_errors),
                wait=wait_exponential_jitter(multiplier=0.2, max=5.0),
                before_sleep=_log_resubscribe,
                reraise=True,
            ):
                with attempt:
                    await self.fetcher.consume(consumer, stop)
            await self._drain(runners)

    def consumer(self) -> FireConsumer:
        return self.settings.broker.consumer(self.settings.ack_wait_s)

    def _release(self, held: Held) -> None:
        finished = self.held.get(held.delivery.fire.fire_id) is held
        if finished:
            del self.held[held.delivery.fire.fire_id]
        self.fetcher.freed(finished)
        self._released.set()

    async def _runner(self) -> None:
        task = asyncio.current_task()
        while True:
            _, _, held = await self.queue.get()
            if held.lost:  # taken over while it waited: the new owner runs it
                try:
                    await self._hand_over(held)
                finally:
                    self._release(held)
                continue
            held.started = True
            held.runner = task
            try:
                outcome = await self.attempts.run(held)
            except BaseException:
                self._release(held)
                raise
            # Recorded behind the runner, which takes the next run at once: the outcomes
            # of runs ending meanwhile share one ledger write.
            self.recorder.submit(held, outcome)

    async def _drain(self, runners: list[asyncio.Task[None]]) -> None:
        """Give back what waits in the queue; let the running runs finish within the
        drain bound; give back the rest."""
        while not self.queue.empty():
            _, _, held = self.queue.get_nowait()
            await (self._hand_over(held) if held.lost else self._give_back(held))
            self._release(held)
        if not self.held:
            return
        log.info(
            "worker_draining", in_flight=len(self.held), within_s=self.settings.drain_timeout_s
        )
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.held and time.monotonic() < deadline:
            self._released.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._released.wait(), deadline - time.monotonic())
        if self.held:
            running = [h for h in self.held.values() if h.started]
            await _cancelled(runners)
            log.warning("runs_given_back", count=len(running))

    async def _answer(self, held: Held, outcome: Outcome, kept: bool | None) -> None:
        """Once the outcome's write is done, tell the broker: ack, nak after the backoff
        (the broker does the waiting), or term. An unrecorded outcome is not answered:
        the broker redelivers, and the run is claimed again once its lease lapses. An
        outcome refused (another worker took the run over) is given back undecided."""
        try:
            if kept is None:
                return
            if not kept:
                log.warning(
                    "run_lease_lost",
                    fire_id=outcome.fire_id,
                    message="another worker took this run over; its outcome stands",
                )
                await self._hand_over(held)
                return
            self.metrics.count(held.delivery.fire.target, outcome.state)
            with contextlib.suppress(*self.broker_errors):
                await self._tell_broker(held.message, outcome)
            if kept and outcome.state == DEAD:
                await self._pause_if_failing(held.delivery.fire, outcome)
        finally:
            self._release(held)

    async def _hand_over(self, held: Held) -> None:
        """A run another worker took over: its message is given back undecided. The new
        owner may hold the same message (on NATS, a redelivery of it), and an ack or term
        from here would settle its run, a retry it asked for included (the run stayed
        retrying for ever). Unanswered, RabbitMQ would keep it on this channel, its
        prefetch slot taken, until the connection closed. A redelivery is answered by a
        claim, as any duplicate is."""
        with contextlib.suppress(*self.broker_errors):
            await held.message.nak()

    async def _pause_if_failing(self, fire: FireRef, outcome: Outcome) -> None:
        """pause_on_failure: N consecutive dead runs of a schedule pause it, saying why."""
        if self.schedules is None:
            return
        schedule_id = fire.schedule_id
        try:
            limit = await self.schedules.pause_on_failure_of(schedule_id)
            if limit is None or not await self.runs.last_dead(schedule_id, limit, fire.namespace):
                return
            note = (
                f"paused after {limit} consecutive dead runs; the last, "
                f"{outcome.fire_id}: {(outcome.error or '')[:500]}"
            )
            if await self.schedules.pause_unless_paused(
                schedule_id, self.clock(), "pause_on_failure", note
            ):
                log.warning("schedule_paused_on_failure", schedule_id=schedule_id, dead_runs=limit)
        except PyMongoError as exc:
            log.warning(
                "pause_on_failure_check_failed", schedule_id=schedule_id, error=repr(exc)[:300]
            )

    async def _tell_broker(self, message: Any, outcome: Outcome) -> None:
        if outcome.state == SUCCEEDED:
            log.debug(
                "run_succeeded",
                fire_id=outcome.fire_id,
                attempt=outcome.attempt,
                duration_s=round((outcome.finished - outcome.started).total_seconds(), 3),
            )
            await message.ack()
        elif outcome.state == RETRYING:
            log.warning(
                "run_failed",
                fire_id=outcome.fire_id,
                attempt=outcome.attempt,
                error=(outcome.error or "")[:300],
                retry_in_s=round(outcome.retry_in_s, 3),
            )
            await message.nak(delay=outcome.retry_in_s)
        elif outcome.state == CANCELLED:
            await message.term()
        else:
            log.error(
                "run_dead",
                fire_id=outcome.fire_id,
                attempt=outcome.attempt,
                error=(outcome.error or "")[:300],
            )
            await message.term()

    async def _heartbeat(self) -> None:
        """Each held message is in progress (the broker does not redeliver it) and every
        claim's lease is extended, in one write (every third of the ack wait)."""
        s = self.settings
        held = dict(self.held)
        if not held:
            return
        for h in held.values():
            with contextlib.suppress(*self.broker_errors):
                await h.message.in_progress()
        try:
            lost = await self.runs.heartbeat(
                {f: h.attempt for f, h in held.items()}, s.worker_id, self.clock(), s.ack_wait_s
            )
            if self.flow is not None:
                await self.flow.renew({f: h.slot for f, h in held.items() if h.slot is not None})
        except PyMongoError as exc:
            log.warning("run_heartbeat_failed", runs=len(held), error=repr(exc)[:300])
            return
        for fire_id in lost:
            held[fire_id].lost = True
            log.warning("run_lease_lost", fire_id=fire_id, started=held[fire_id].started)

    async def _watch_cancels(self) -> None:
        """Stop the held runs an operator cancelled (every CANCEL_POLL_S): an async
        handler's task is cancelled; a synchronous handler sees the flag."""
        held = {f: h for f, h in self.held.items() if not h.cancelled.is_set()}
        if not held:
            return
        try:
            cancelled = await self.runs.cancels_requested(list(held), self.settings.worker_id)
        except PyMongoError as exc:
            log.warning("run_cancel_check_failed", error=repr(exc)[:300])
            return
        for fire_id in cancelled:
            h = held[fire_id]
            h.cancelled.set()
            log.info("run_cancel_requested", fire_id=fire_id, started=h.started)
            if h.started and h.route.is_async:
                h.stop()

    async def _give_back(self, held: Held) -> None:
        with contextlib.suppress(PyMongoError, *self.broker_errors):
            await self.runs.release(
                held.delivery.fire.fire_id,
                self.settings.worker_id,
                held.attempt,
                self.clock(),
                "the worker stopped before the run finished",
            )
            await held.message.nak()
            await self._ended([held])
        self.metrics.count(held.delivery.fire.target, "released")

    async def _ended(self, helds: list[Held]) -> None:
        """These runs are over here: their concurrency slots go to the runs parked on
        their keys."""
        if self.flow is None:
            return
        freed = {h.delivery.fire.fire_id: h.slot for h in helds if h.slot is not None}
        try:
            await self.flow.release(freed)
        except PyMongoError as exc:  # the slots lapse with their leases, and are swept
            log.warning("slot_release_failed", runs=len(freed), error=repr(exc)[:300])

    async def _sweep_slots(self) -> None:
        assert self.flow is not None
        try:
            await self.flow.sweep()
        except PyMongoError as exc:
            log.warning("slot_sweep_failed", error=repr(exc)[:300])


async def _cancelled(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks, timeout=lifecycle.STOP_STEP_S)


def _log_resubscribe(state: RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome else None
    log.warning("worker_resubscribing", error=repr(error), attempt=state.attempt_number)
