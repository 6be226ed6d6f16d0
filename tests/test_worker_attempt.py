"""One attempt in a runner, in process: its timeout, an operator's cancel, a drain's cancel,
and a handler that swallows its cancel, each leaving the runner fit for its next run."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
from typing import Any

import pytest

from hascheduler.worker import RetryPolicy, Run, WorkerApp
from hascheduler.worker.app import Route
from hascheduler.worker.attempts import Attempts
from hascheduler.worker.delivery import read_delivery
from hascheduler.worker.held import Held
from hascheduler.worker.metrics import WorkerMetrics

TIMEOUT_S = 0.05


def held_run(route: Route, fire_id: str) -> tuple[Held, Run]:
    nominal = dt.datetime.now(dt.UTC)
    body = json.dumps(
        {
            "specversion": "1.0",
            "id": fire_id,
            "source": "/hascheduler",
            "type": "io.hascheduler.fire",
            "data": {
                "schedule_id": "s",
                "term": 1,
                "nominal_at": nominal.isoformat(),
                "payload": {},
            },
        }
    ).encode()
    delivery = read_delivery("hascheduler.fire.jobs.a", body)
    held = Held(None, delivery, route, attempt=1)
    run = Run(
        fire_id=fire_id,
        target="jobs.a",
        schedule_id="s",
        nominal_at=nominal,
        payload={},
        attempt=1,
        worker_id="w",
        event={},
        cancelled=held.cancelled,
    )
    return held, run


async def forever() -> None:
    """A handler's work that never ends on its own: only a cancel stops it."""
    await asyncio.Event().wait()


def a_worker(handler: Any, timeout_s: float = TIMEOUT_S) -> tuple[Attempts, Route, list[str]]:
    app = WorkerApp(policy=RetryPolicy(max_attempts=1, timeout_s=timeout_s))
    app.add("jobs.*", handler)
    given_back: list[str] = []

    async def give_back(held: Held) -> None:
        given_back.append(held.delivery.fire.fire_id)

    route = app.route("jobs.a")
    assert route is not None
    return (
        Attempts("w", lambda: dt.datetime.now(dt.UTC), WorkerMetrics(), give_back),
        route,
        given_back,
    )


async def attempts(
    worker: Attempts, route: Route, fire_ids: list[str], meanwhile: Any = None
) -> list[Any]:
    """Each fire's attempt in turn, in one runner task (as Worker._runner runs them);
    ``meanwhile(held)`` is started beside the first. The runner's task is checked for
    cancels left standing after each."""
    outcomes = []

    async def runner() -> None:
        task = asyncio.current_task()
        assert task is not None
        for i, fire_id in enumerate(fire_ids):
            held, run = held_run(route, fire_id)
            held.runner = task
            side = asyncio.create_task(meanwhile(held)) if meanwhile and i == 0 else None
            outcomes.append(await worker.attempt(held, run, route))
            assert task.cancelling() == 0
            if side is not None:
                await side

    await asyncio.wait_for(runner(), 10)
    return outcomes


async def test_an_attempt_past_its_timeout_ends_run_timeout_and_the_runner_goes_on() -> None:
    async def handler(run: Run) -> None:
        if run.fire_id == "slow@1":
            await forever()

    worker, route, given_back = a_worker(handler)
    slow, quick = await attempts(worker, route, ["slow@1", "quick@1"])
    assert slow.state == "dead"
    assert slow.error.startswith("RunTimeout: the run took longer than 0.05 s")
    assert quick.state == "succeeded"
    assert given_back == []


async def test_a_handler_that_swallows_its_timeout_ends_as_it_returns() -> None:
    """As asyncio.timeout would: the handler caught the cancel and returned normally, so
    the attempt succeeded; the cancel is taken back, so the next run is not disturbed."""

    async def handler(run: Run) -> None:
        if run.fire_id == "stubborn@1":
            with contextlib.suppress(asyncio.CancelledError):
                await forever()

    worker, route, given_back = a_worker(handler)
    stubborn, after = await attempts(worker, route, ["stubborn@1", "after@1"])
    assert stubborn.state == "succeeded"
    assert after.state == "succeeded"
    assert given_back == []


@pytest.mark.parametrize("with_timeout", [False, True])
async def test_an_operators_cancel_ends_the_attempt_cancelled_even_at_its_timeout(
    with_timeout: bool,
) -> None:
    """The operator's cancel alone (a timeout far off), or with the timeout's in the same
    turn of the loop (the timer calls the same ``stop``): two cancels on the runner, both
    taken back, and the attempt ends cancelled, not timed out."""
    started = asyncio.Event()

    async def handler(run: Run) -> None:
        if run.fire_id == "wanted@1":
            started.set()
            await forever()

    async def cancel(held: Held) -> None:
        await asyncio.wait_for(started.wait(), 5)
        held.cancelled.set()
        held.stop()
        if with_timeout:
            held.stop()  # what the attempt's timer does when it fires

    worker, route, given_back = a_worker(handler, TIMEOUT_S if with_timeout else 60.0)
    wanted, after = await attempts(worker, route, ["wanted@1", "after@1"], cancel)
    assert wanted.state == "cancelled"
    assert after.state == "succeeded"
    assert given_back == []


async def test_a_drains_cancel_gives_the_run_back_and_stops_the_runner() -> None:
    started = asyncio.Event()

    async def handler(run: Run) -> None:
        started.set()
        await forever()

    worker, route, given_back = a_worker(handler)
    held, run = held_run(route, "drained@1")

    async def attempt() -> None:  # a runner, as the worker's are
        await worker.attempt(held, run, route)

    runner = asyncio.create_task(attempt())
    held.runner = runner
    await asyncio.wait_for(started.wait(), 5)
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    assert given_back == ["drained@1"]
