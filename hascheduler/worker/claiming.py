"""A worker's claiming: a fetched batch read (a message that is not a fire is terminated,
a stale one dropped), its concurrency slots and rate starts taken, its runs claimed in the
runs ledger in one write, and each claimed run handed to the runners (``hold``); a run over
its key's limit or rate parked in the ledger; a fire running elsewhere offered again when
that claim could lapse; one already finished acknowledged. How far ahead of the runners to
claim (``ClaimAhead``) is decided here too."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import structlog
from pymongo.errors import PyMongoError

from hascheduler.brokers.base import Delivered, FireConsumer
from hascheduler.core.clock import Clock
from hascheduler.core.flow import Paced, Wanted
from hascheduler.core.run_states import CANCELLED, DEAD, PARKED, RUNNING, SUCCEEDED, WAITING
from hascheduler.process import tracing
from hascheduler.storage.run_records import RunClaim
from hascheduler.storage.runs import RunLedger
from hascheduler.worker.app import Route
from hascheduler.worker.delivery import Delivery, NotAFire, StaleFilter, read_delivery
from hascheduler.worker.flow import FlowGate, slot_wanted, start_paced
from hascheduler.worker.held import Held
from hascheduler.worker.metrics import WorkerMetrics
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
# The ledger may be unreachable (a failover): a claim is retried by the broker after this.
LEDGER_DOWN_DELAY_S = 2.0
# A fire running elsewhere is offered again once that claim could have lapsed, plus this.
BUSY_MARGIN_S = 0.5


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


class Claimer:
    """Claims the runs of fetched fires and hands each claimed one to ``hold``."""

    def __init__(
        self,
        settings: WorkerSettings,
        runs: RunLedger,
        metrics: WorkerMetrics,
        clock: Clock,
        flow: FlowGate | None,
        hold: Callable[[Held], None],
    ) -> None:
        self.settings = settings
        self.broker_errors = settings.broker.kind.errors()
        self.app = settings.app
        self.runs = runs
        self.metrics = metrics
        self.clock = clock
        self.flow = flow
        self.hold = hold
        self.stale = StaleFilter()

    async def claim(self, messages: Sequence[Delivered]) -> None:
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
            self.hold(held)
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


class Runners(Protocol):
    """What fetching asks of the runners: how many runs they hold, and to take one."""

    def holding(self) -> int: ...

    def hold(self, held: Held) -> None: ...


class Fetcher:
    """The fetch loop: fetches as many fires as the runners have room for (with the
    claim-ahead), and claims each fetch while the next one goes out."""

    def __init__(self, settings: WorkerSettings, claimer: Claimer, runners: Runners) -> None:
        self.settings = settings
        # What the broker's client may throw at a consumer: one subscription ends, not
        # the worker.
        self.broker_errors = settings.broker.kind.errors()
        self.claimer = claimer
        self.runners = runners
        # Claimed ahead of a free runner, so one fetch and one claim serve several fires;
        # the heartbeat keeps queued claims alive like running ones.
        self.ahead = ClaimAhead(claim_floor(settings.concurrency), MAX_AHEAD)
        self.prefetch = pushed_prefetch(settings.concurrency)
        self.room = asyncio.Event()  # set when a run or a claim write ends
        self.claims: set[asyncio.Task[None]] = set()  # claim writes in flight
        self.claiming = 0  # messages fetched, their claims in flight
        self.announced = False

    def freed(self, finished: bool) -> None:
        """A run left the runners (``finished``: it was theirs to the end)."""
        if finished:
            self.ahead.finished()
        self.room.set()

    async def consume(self, consumer: FireConsumer, stop: asyncio.Event) -> None:
        """Subscribe (creating the queues or the durable consumer if they are gone) and
        claim runs until ``stop``."""
        s = self.settings
        await consumer.subscribe(s.durable, s.app.patterns, s.ack_wait_s, self.prefetch)
        log.info("worker_subscribed", durable=s.durable)
        if not self.announced:
            # Once subscribed: on RabbitMQ a fire published before the queue is bound has
            # nowhere to go.
            print(
                f"worker {s.worker_id} consuming {', '.join(s.app.patterns)} as {s.durable}",
                flush=True,
            )
            self.announced = True
        while not stop.is_set():
            bound = self.settings.concurrency + self.ahead.current()
            if consumer.pushes:  # past the prefetch, a fetch takes each delivery alone
                bound = min(bound, self.prefetch)
            free = bound - self.runners.holding() - self.claiming
            if free < max(1, s.concurrency):
                # Wait until a runners' worth is free: one fetch and one claim serve them.
                # RabbitMQ delivers a message per ack, one by one, so fetching sooner
                # takes a handful each time, each handful a claim's round trip.
                self.room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.room.wait(), FETCH_WAIT_S)
                continue
            messages = await consumer.fetch(free, FETCH_WAIT_S)
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
            await self.claimer.claim(messages)
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
            self.room.set()


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
