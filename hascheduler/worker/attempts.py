"""One attempt of a run: its handler called within its timeout, an operator's cancel or a
drain's honoured, and the outcome decided by the retry policy (worker/policy.py)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import datetime as dt
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import structlog

from hascheduler.core.clock import Clock
from hascheduler.core.run_states import (
    CANCELLED,
    DEAD,
    RETRYING,
    SUCCEEDED,
)
from hascheduler.process import tracing
from hascheduler.storage.run_records import Outcome
from hascheduler.worker.app import Route, Run
from hascheduler.worker.held import Held
from hascheduler.worker.metrics import WorkerMetrics
from hascheduler.worker.policy import PermanentFailure, RunTimeout, after_failure

log = structlog.get_logger("hascheduler.worker")

# A fire's W3C traceparent: its trace id is kept on the run, for the dashboard's link.
TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")


class Attempts:
    def __init__(
        self,
        worker_id: str,
        clock: Clock,
        metrics: WorkerMetrics,
        give_back: Callable[[Held], Awaitable[None]],
    ) -> None:
        self.worker_id = worker_id
        self.clock = clock
        self.metrics = metrics
        # A run whose attempt the drain cancelled goes back to the broker for another
        # worker, at once.
        self.give_back = give_back

    async def run(self, held: Held) -> Outcome:
        """One attempt of ``held``'s handler, to its outcome (with the fire's trace id)."""
        fire, attempt, route = held.delivery.fire, held.attempt, held.route
        run = Run(
            fire_id=fire.fire_id,
            target=fire.target,
            schedule_id=fire.schedule_id,
            nominal_at=fire.nominal_at,
            payload=held.delivery.payload,
            attempt=attempt,
            worker_id=self.worker_id,
            event=fire.event,
            tenant=held.delivery.tenant,
            cancelled=held.cancelled,
        )
        with _attempt_span(held) as span:
            outcome = await self.attempt(held, run, route)
            if span is not None:
                _record_outcome(span, outcome)
        traced = TRACEPARENT.fullmatch(held.delivery.traceparent or "")
        if traced is not None:
            outcome = dataclasses.replace(outcome, trace_id=traced.group(1))
        return outcome

    async def attempt(self, held: Held, run: Run, route: Route) -> Outcome:
        """The handler called once within its timeout; its outcome by the retry policy."""
        fire, attempt = held.delivery.fire, held.attempt
        started, began = self.clock(), time.monotonic()
        log.debug("run_started", fire_id=fire.fire_id, attempt=attempt)
        error: BaseException | None = None
        task = held.runner  # this runner's task (None outside one: nothing cancels it)
        with self.metrics.in_flight(fire.target):
            try:
                if held.key_error is not None:
                    raise PermanentFailure(held.key_error)
                if not held.cancelled.is_set():  # not cancelled while it was queued
                    # A timer of the loop's own, cancelling the runner as an operator's
                    # cancel does: lighter than asyncio.timeout's bookkeeping per run.
                    loop = asyncio.get_running_loop()
                    timer = loop.call_at(loop.time() + route.policy.timeout_s, held.stop)
                    try:
                        await _call(route, run)
                    finally:
                        timer.cancel()
                    if held.stops and task is not None:
                        # The handler swallowed its cancel: taken back, or the runner's
                        # next run would take a cancel meant for this one as the drain's.
                        _uncancelled(task, held.stops)
            except asyncio.CancelledError:
                if not held.stops or task is None or _uncancelled(task, held.stops) > 0:
                    # The drain ran out: give the run back for another worker, right away.
                    await asyncio.shield(self.give_back(held))
                    raise
                if not held.cancelled.is_set():
                    error = RunTimeout(f"the run took longer than {route.policy.timeout_s:g} s")
            except Exception as exc:
                error = exc
            finally:
                held.runner = None  # the runner goes on to other runs: not to be cancelled
        # The duration is the monotonic clock's: two readings of the server clock's bounds
        # may narrow or widen between them.
        finished = started + dt.timedelta(seconds=time.monotonic() - began)
        self.metrics.duration(fire.target, (finished - started).total_seconds())
        if held.cancelled.is_set():  # whatever the handler did after the cancel
            log.info("run_cancelled", fire_id=fire.fire_id, attempt=attempt)
            return Outcome(
                fire.fire_id,
                self.worker_id,
                attempt,
                started,
                finished,
                CANCELLED,
                "cancelled by an operator",
            )
        if error is None:
            return Outcome(fire.fire_id, self.worker_id, attempt, started, finished, SUCCEEDED)
        verdict = after_failure(route.policy, attempt, error)
        if verdict.outcome == "retry":
            return Outcome(
                fire.fire_id,
                self.worker_id,
                attempt,
                started,
                finished,
                RETRYING,
                verdict.error,
                verdict.delay_s,
            )
        return Outcome(
            fire.fire_id,
            self.worker_id,
            attempt,
            started,
            finished,
            DEAD,
            verdict.error,
            event=fire.body,
        )


def _uncancelled(task: asyncio.Task[Any], times: int) -> int:
    """Take back ``times`` cancels of ``task``: the cancels still standing (others')."""
    left = task.cancelling()
    for _ in range(times):
        left = task.uncancel()
    return left


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

    # In a copy of the caller's context: the attempt's span (tracing on) is current in the
    # handler's thread too, so the handler's own spans and log lines join its trace.
    threading.Thread(
        target=contextvars.copy_context().run,
        args=(body,),
        name=f"run {run.fire_id}"[:60],
        daemon=True,
    ).start()
    await done


@contextlib.contextmanager
def _attempt_span(held: Held) -> Iterator[tracing.Span | None]:
    """The span of one attempt, current while the handler runs (its own spans nest)."""
    if held.trace is None:
        yield None
        return
    fire = held.delivery.fire
    with tracing.tracer().start_as_current_span(
        f"run {fire.target}",
        context=held.trace,
        attributes={
            "hascheduler.fire_id": fire.fire_id,
            "hascheduler.schedule_id": fire.schedule_id,
            "hascheduler.attempt": held.attempt,
        },
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        yield span


def _record_outcome(span: tracing.Span, outcome: Outcome) -> None:
    """Retries and dead outcomes are events on the attempt's span."""
    span.set_attribute("hascheduler.outcome", outcome.state)
    if outcome.state == SUCCEEDED:
        span.set_status(tracing.Status(tracing.StatusCode.OK))
        return
    attributes: dict[str, str | float] = {"error": (outcome.error or "")[:1000]}
    if outcome.state == RETRYING:
        attributes["retry_in_s"] = round(outcome.retry_in_s, 3)
    span.add_event({RETRYING: "retry", DEAD: "dead"}.get(outcome.state, outcome.state), attributes)
    if outcome.state in (RETRYING, DEAD):
        span.set_status(tracing.Status(tracing.StatusCode.ERROR, (outcome.error or "")[:200]))
