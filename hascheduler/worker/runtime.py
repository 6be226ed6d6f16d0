"""``hascheduler worker``: a durable consumer (JetStream or RabbitMQ, a FireSource) that
runs each fire to an outcome.

A fetch loop reads each delivered fire (a message that is not a fire is terminated), drops
it if stale (delivery.StaleFilter), and claims the runs of a whole fetch in the runs ledger
in one write (a fire already running elsewhere comes back when that claim could lapse; one
already finished is acknowledged). Claimed runs wait in a queue for one of
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
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import structlog
from pymongo.errors import PyMongoError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    wait_exponential_jitter,
)

from hascheduler.brokers.base import Delivered, FireSource
from hascheduler.core.clock import Clock
from hascheduler.core.flow import Paced, Wanted, rank
from hascheduler.core.run_states import (
    CANCELLED,
    DEAD,
    PARKED,
    RETRYING,
    RUNNING,
    SUCCEEDED,
    WAITING,
)
from hascheduler.process import lifecycle, tracing
from hascheduler.process.lifecycle import Every
from hascheduler.storage.run_records import Outcome, RunClaim
from hascheduler.storage.runs import RunLedger
from hascheduler.storage.schedules import ScheduleStore
from hascheduler.worker.app import Route
from hascheduler.worker.attempts import Attempts
from hascheduler.worker.delivery import Delivery, NotAFire, StaleFilter, read_delivery
from hascheduler.worker.flow import (
    LAPSED_SWEEP_S,
    FlowGate,
    RateWaker,
    slot_wanted,
    start_paced,
)
from hascheduler.worker.held import Held
from hascheduler.worker.metrics import WorkerMetrics
from hascheduler.worker.recorder import Recorder
from hascheduler.worker.settings import WorkerSettings

log = structlog.get_logger("hascheduler.worker")

FETCH_WAIT_S = 0.5  # an idle fetch's wait: how promptly a stop is noticed
PREFETCH = 8  # runs claimed ahead of the runners, at least (twice --concurrency)
# Runs quick enough to finish by the thousand a second are claimed further ahead: as many
# as the runners finish in AHEAD_S at their pace over the last PACE_WINDOW_S, up to
# MAX_AHEAD. One fetch, one claim and one record then serve many runs, and the next
# batch's round trips overlap the runners' work; slow runs keep the floor, so a worker
# does not hold fires that another one's idle runners could start.
AHEAD_S = 0.03
PACE_WINDOW_S = 0.1
MAX_AHEAD = 500
# A fire running elsewhere is offered again once that claim could have lapsed, plus this.
BUSY_MARGIN_S = 0.5
# The ledger may be unreachable (a failover): a claim is retried by the broker after this.
LEDGER_DOWN_DELAY_S = 2.0
# How often a worker holding runs asks which were cancelled: a cancel takes effect within
# this plus a round trip (under the promised second).
CANCEL_POLL_S = 0.5


class Fetched(NamedTuple):
    """A delivered fire read and routed, before its run is claimed."""

    message: Any  # the broker's message (Delivered), answered once its run is dealt with
    delivery: Delivery
    route: Route


def claim_floor(concurrency: int) -> int:
    """The fewest runs a worker claims ahead of its runners."""
    return max(2 * concurrency, PREFETCH)


def pushed_prefetch(concurrency: int) -> int:
    """A pushing broker's prefetch: twice the runners and the claim-ahead's floor, so
    that the next batch is on its way while one is claimed and run (with a prefetch of
    one batch, every fetch took the whole of it, then waited behind its acks for the
    next)."""
    return 2 * (concurrency + claim_floor(concurrency))


class ClaimAhead:
    """How many runs to claim ahead of the runners: what they finish in AHEAD_S at the
    pace of the last PACE_WINDOW_S, at least ``floor``, at most ``ceiling``."""

    def __init__(
        self, floor: int, ceiling: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.floor, self.ceiling = floor, max(floor, ceiling)
        self.clock = clock
        self._since, self._finished, self._ahead = clock(), 0, floor

    def finished(self) -> None:
        self._finished += 1

    def current(self) -> int:
        now = self.clock()
        elapsed = now - self._since
        if elapsed >= PACE_WINDOW_S:  # a window without finishes falls back to the floor
            pace = self._finished / elapsed
            self._ahead = min(self.ceiling, max(self.floor, round(pace * AHEAD_S)))
            self._since, self._finished = now, 0
        return self._ahead


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
        # What the broker's client may throw at a consumer: one subscription ends, not
        # the worker.
        self.broker_errors = settings.broker.kind.errors()
        self.schedules = schedules
        self.flow = flow
        self.app = settings.app
        self.runs = runs
        self.metrics = metrics
        self.clock = clock
        self.stale = StaleFilter()
        self.recorder = Recorder(runs, settings.ack_wait_s, self._answer, self._ended)
        self.attempts = Attempts(settings.worker_id, clock, metrics, self._give_back)
        self.held: dict[str, Held] = {}
        # Claimed runs waiting for a runner, by rank: priority, aged (core/flow.rank).
        self.queue: asyncio.PriorityQueue[tuple[float, int, Held]] = asyncio.PriorityQueue()
        self._queued = itertools.count()
        # Claimed ahead of a free runner, so one fetch and one claim serve several fires;
        # the heartbeat keeps queued claims alive like running ones.
        self.ahead = ClaimAhead(claim_floor(settings.concurrency), MAX_AHEAD)
        self.prefetch = pushed_prefetch(settings.concurrency)
        self._released = asyncio.Event()
        self.claims: set[asyncio.Task[None]] = set()  # claim writes in flight
        self.claiming = 0  # messages fetched, their claims in flight
        self.announced = False

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop``, then drain. Its parts live on one exit stack, unwound
        in reverse: the runners, the cancel watch, the heartbeat, the recorder (which
        writes the outcomes it holds first), the broker connection."""
        s = self.settings
        source = self.source()
        async with contextlib.AsyncExitStack() as stack:
            await source.connect(s.durable)
            stack.push_async_callback(lifecycle.bounded, "broker connection", source.close)
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
                patterns=self.app.patterns,
                durable=s.durable,
                concurrency=s.concurrency,
            )
            # A broker hiccup (a restart, a lost consumer, a request timing out) ends one
            # subscription, never the worker: subscribe again after a capped, jittered wait.
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(self.broker_errors),
                wait=wait_exponential_jitter(initial=0.2, max=5.0),
                before_sleep=_log_resubscribe,
                reraise=True,
            ):
                with attempt:
                    await self._consume(source, stop)
            await self._drain(runners)

    def source(self) -> FireSource:
        return self.settings.broker.source(self.settings.ack_wait_s)

    async def _consume(self, source: FireSource, stop: asyncio.Event) -> None:
        """Subscribe (creating the queues or the durable consumer if they are gone) and
        claim runs until ``stop``."""
        s = self.settings
        await source.subscribe(s.durable, self.app.patterns, s.ack_wait_s, self.prefetch)
        log.info("worker_subscribed", durable=s.durable)
        if not self.announced:
            # Once subscribed: on RabbitMQ a fire published before the queue is bound has
            # nowhere to go.
            print(
                f"worker {s.worker_id} consuming {', '.join(self.app.patterns)} as {s.durable}",
                flush=True,
            )
            self.announced = True
        while not stop.is_set():
            bound = self.settings.concurrency + self.ahead.current()
            if source.pushes:  # past the prefetch, a fetch takes each delivery alone
                bound = min(bound, self.prefetch)
            free = bound - len(self.held) - self.claiming
            if free < max(1, s.concurrency):
                # Wait until a runners' worth is free: one fetch and one claim serve them.
                # RabbitMQ delivers a message per ack, one by one, so fetching sooner
                # takes a handful each time, each handful a claim's round trip.
                self._released.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._released.wait(), FETCH_WAIT_S)
                continue
            messages = await source.fetch(free, FETCH_WAIT_S)
            if not messages:
                log.debug("fetch_idle")
                continue
            # Claimed while the next fetch goes out: the two round trips overlap.
            self.claiming += len(messages)
            claiming = asyncio.create_task(self._claim_batch(messages))
            self.claims.add(claiming)
            claiming.add_done_callback(self.claims.discard)
        await asyncio.gather(*self.claims, return_exceptions=True)

    async def _claim_batch(self, messages: Sequence[Delivered]) -> None:
        try:
            await self._claim(messages)
        except PyMongoError as exc:
            log.warning("run_claim_failed", count=len(messages), error=repr(exc)[:300])
            for message in messages:
                with contextlib.suppress(*self.broker_errors):
                    await message.nak(delay=LEDGER_DOWN_DELAY_S)
        except self.broker_errors as exc:
            log.warning("run_claim_failed", count=len(messages), error=repr(exc)[:300])
        except Exception as exc:
            # A defect, not the broker or the ledger: said loudly, and the messages are left
            # to the broker's redelivery rather than lost with a silent task.
            log.exception("run_claim_crashed", count=len(messages), error=repr(exc)[:300])
        finally:
            self.claiming -= len(messages)
            self._released.set()

    async def _claim(self, messages: Sequence[Delivered]) -> None:
        """Read a fetched batch, claim its runs in one write, queue the claimed ones."""
        received = self.clock()
        ready: list[Fetched] = []
        for message in messages:
            picked = await self._screen(message, received)
            if picked is not None:
                ready.append(Fetched(message, *picked))
        # The same fire twice in one batch: the first is claimed with the batch, the
        # second afterwards (it then finds the first's claim).
        first: dict[str, int] = {}
        for i, (_, delivery, _) in enumerate(ready):
            first.setdefault(delivery.fire.fire_id, i)
        batch = [ready[i] for i in sorted(first.values())]
        again = [r for i, r in enumerate(ready) if first[r.delivery.fire.fire_id] != i]
        s = self.settings
        slots, key_errors, over = await self._take_slots(batch, received)
        batch = [r for r in batch if r.delivery.fire.fire_id not in over]
        spans = _claim_spans(batch, received) if tracing.enabled() else {}
        claims = await self.runs.claim_many(
            [d.fire for _, d, _ in batch], s.worker_id, received, s.ack_wait_s
        )
        for (message, delivery, route), claim in zip(batch, claims, strict=True):
            fire_id = delivery.fire.fire_id
            await self._claimed(
                message,
                delivery,
                route,
                claim,
                spans.get(fire_id),
                slots.get(fire_id),
                key_errors.get(fire_id),
            )
        for message, delivery, route in again:
            claim = await self.runs.claim(delivery.fire, s.worker_id, self.clock(), s.ack_wait_s)
            await self._claimed(
                message,
                delivery,
                route,
                claim,
                _claim_spans([Fetched(message, delivery, route)], received).get(
                    delivery.fire.fire_id
                )
                if tracing.enabled()
                else None,
            )
        if over:
            await self._park(list(over.values()))

    async def _take_slots(
        self, batch: list[Fetched], now: dt.datetime
    ) -> tuple[dict[str, Wanted], dict[str, str], dict[str, tuple[Fetched, Wanted | Paced]]]:
        """The slots the batch's runs want (by fire id), why any cannot say which, and
        the runs over their key's limit or rate (to park, with what they wait for):
        the slots taken in one go, then each rate-limited run's start."""
        slots: dict[str, Wanted] = {}
        paced: dict[str, Paced] = {}
        key_errors: dict[str, str] = {}
        if self.flow is None:
            return slots, key_errors, {}
        for _, delivery, route in batch:
            fire_id = delivery.fire.fire_id
            for want in (slot_wanted(delivery, route), start_paced(delivery, route)):
                if isinstance(want, Wanted):
                    slots[fire_id] = want
                elif isinstance(want, Paced):
                    paced[fire_id] = want
                elif want is not None:
                    key_errors.setdefault(fire_id, want)
        if not slots and not paced:
            return slots, key_errors, {}
        held = await self.flow.take(slots) if slots else set()
        over: dict[str, tuple[Fetched, Wanted | Paced]] = {
            r.delivery.fire.fire_id: (r, slots[r.delivery.fire.fire_id])
            for r in batch
            if r.delivery.fire.fire_id in slots and r.delivery.fire.fire_id not in held
        }
        unpaced: dict[str, Wanted] = {}
        for r in batch:
            fire_id = r.delivery.fire.fire_id
            if (
                fire_id in paced
                and fire_id not in over
                and not await self.flow.pace(paced[fire_id], now)
            ):
                over[fire_id] = (r, paced[fire_id])
                if fire_id in slots:
                    unpaced[fire_id] = slots[fire_id]
        await self.flow.release(unpaced)  # held a slot, but may not start yet
        return slots, key_errors, over

    async def _park(self, over: list[tuple[Fetched, Wanted | Paced]]) -> None:
        """Over their key's limit or rate: wait in the ledger, not in the broker or a
        runner."""
        assert self.flow is not None
        answers = await self.flow.park([(d.fire, on, d.priority) for (_, d, _), on in over])
        acks = []
        for (message, delivery, route), on in over:
            fire = delivery.fire
            outcome, taken = answers[fire.fire_id]
            if taken:  # a slot freed meanwhile: run it after all
                assert isinstance(on, Wanted)
                claim = await self.runs.claim(
                    fire, self.settings.worker_id, self.clock(), self.settings.ack_wait_s
                )
                await self._claimed(message, delivery, route, claim, slot=on)
            elif outcome == PARKED:
                log.debug(
                    "run_waiting",
                    fire_id=fire.fire_id,
                    key=on.key,
                    on="concurrency" if isinstance(on, Wanted) else "rate",
                )
                self.metrics.count(fire.target, WAITING)
                acks.append(message.ack())
            else:  # running elsewhere, ended, or a retry not yet due: as a claim answers
                await self._claimed(message, delivery, route, RunClaim(outcome))
        for done in await asyncio.gather(*acks, return_exceptions=True):
            if isinstance(done, BaseException) and not isinstance(done, self.broker_errors):
                raise done

    async def _screen(self, message: Any, received: dt.datetime) -> tuple[Delivery, Route] | None:
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

    async def _claimed(
        self,
        message: Any,
        delivery: Delivery,
        route: Route,
        claim: RunClaim,
        span: tracing.Span | None = None,
        slot: Wanted | None = None,
        key_error: str | None = None,
    ) -> None:
        fire_id, target = delivery.fire.fire_id, delivery.fire.target
        if (
            slot is not None
            and not claim.claimed
            and claim.outcome != RUNNING
            and self.flow is not None
        ):
            # Taken for a run that will not start here (ended, or its retry not due); a
            # run running elsewhere keeps the slot its fire holds.
            await self.flow.release({fire_id: slot})
        if span is not None:
            span.set_attribute(
                "hascheduler.claim", "claimed" if claim.claimed else str(claim.outcome)
            )
            span.set_attribute("hascheduler.attempt", claim.attempt)
            span.end()
        if claim.claimed:
            if claim.took_over:
                log.warning(
                    "run_taken_over",
                    fire_id=fire_id,
                    from_worker=claim.took_over,
                    attempt=claim.attempt,
                )
            held = Held(
                message,
                delivery,
                route,
                claim.attempt,
                trace=None if span is None else tracing.parent_of(span),
                slot=slot,
                key_error=key_error,
            )
            self.held[fire_id] = held
            self.queue.put_nowait(
                (rank(delivery.priority, time.monotonic()), next(self._queued), held)
            )
        elif claim.outcome in (SUCCEEDED, DEAD):
            log.info("fire_duplicate_dropped", fire_id=fire_id, state=claim.outcome)
            self.metrics.count(target, "duplicate")
            await message.ack()
        elif claim.outcome == CANCELLED:  # cancelled before any worker claimed it
            log.info("fire_cancelled_dropped", fire_id=fire_id)
            self.metrics.count(target, CANCELLED)
            await message.term()
        else:  # running elsewhere, or waiting for its retry: back when it could be ours
            log.info(
                "fire_busy", fire_id=fire_id, state=claim.outcome, wait_s=round(claim.wait_s, 3)
            )
            self.metrics.count(target, "busy")
            await message.nak(delay=claim.wait_s + BUSY_MARGIN_S)

    def _release(self, held: Held) -> None:
        if self.held.get(held.delivery.fire.fire_id) is held:
            del self.held[held.delivery.fire.fire_id]
            self.ahead.finished()
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
                await self._pause_if_failing(held.delivery.fire.schedule_id, outcome)
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

    async def _pause_if_failing(self, schedule_id: str, outcome: Outcome) -> None:
        """pause_on_failure: N consecutive dead runs of a schedule pause it, saying why."""
        if self.schedules is None:
            return
        try:
            limit = await self.schedules.pause_on_failure_of(schedule_id)
            if limit is None or not await self.runs.last_dead(schedule_id, limit):
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


def _claim_spans(batch: Sequence[Fetched], received: dt.datetime) -> dict[str, tracing.Span]:
    """One consumer span per fire claimed, child of its publish span (tracing on); only a
    sampled one is given attributes."""
    tracer = tracing.tracer()
    start = int(received.timestamp() * 1e9)
    consumer = tracing.SpanKind.CONSUMER
    spans = {}
    for _, d, _ in batch:
        span = tracer.start_span(
            f"claim {d.fire.target}",
            context=tracing.context_of(d.traceparent, d.tracestate),
            kind=consumer,
            start_time=start,
        )
        if span.is_recording():
            span.set_attributes(
                {
                    "messaging.operation.type": "process",
                    "messaging.destination.name": d.fire.target,
                    "messaging.message.id": d.fire.fire_id,
                    "hascheduler.schedule_id": d.fire.schedule_id,
                }
            )
        spans[d.fire.fire_id] = span
    return spans
