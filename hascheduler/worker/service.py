"""``hascheduler worker``'s composition root: the process that connects, creates the
ledgers' indexes, samples the database's clock and runs the worker (runtime.py) until
SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from typing import Any

import structlog
from pymongo.errors import PyMongoError
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    wait_exponential_jitter,
)

from hascheduler.core.clock import ServerClock
from hascheduler.core.constants import (
    CLOCK_SAMPLE_S,
    DEFAULT_DATABASE,
    RATES,
    RUNS,
    SCHEDULES,
    SLOTS,
)
from hascheduler.process import lifecycle, logs, tracing
from hascheduler.process.lifecycle import Every
from hascheduler.process.metrics import watch_clock
from hascheduler.storage.driver import connect
from hascheduler.storage.flow import RateStore, SlotStore
from hascheduler.storage.runs import RunLedger
from hascheduler.storage.schedules import ScheduleStore
from hascheduler.storage.server_time import sample, sampler
from hascheduler.worker.flow import (
    FlowGate,
)
from hascheduler.worker.metrics import WorkerMetrics
from hascheduler.worker.runtime import Worker
from hascheduler.worker.settings import WorkerSettings

log = structlog.get_logger("hascheduler.worker")


async def run_worker(settings: WorkerSettings) -> int:
    """Run until SIGTERM or SIGINT, then drain within ``drain_timeout_s``."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    logs.identify(settings.worker_id)
    traced = tracing.configure("hascheduler-worker")
    metrics = WorkerMetrics()
    if settings.metrics_port is not None:
        metrics.serve(settings.metrics_port)
    client = connect(
        settings.mongodb_uri,
        appname=f"hascheduler-worker/{settings.worker_id}",
        serverSelectionTimeoutMS=5000,
    )
    try:
        db = client.get_default_database(DEFAULT_DATABASE)
        runs = RunLedger(db[RUNS])
        await _until_up(
            "creating the runs ledger's indexes",
            lambda: runs.ensure_indexes(settings.run_retention_s),
            stop,
        )
        slots, rates = SlotStore(db[SLOTS]), RateStore(db[RATES])
        await _until_up("creating the slots' indexes", slots.ensure_indexes, stop)
        await _until_up("creating the rates' indexes", rates.ensure_indexes, stop)
        # Run leases and retry times are judged on the database's clock, whatever this
        # host's says: a worker whose clock ran ahead would take over runs still held.
        clock = ServerClock()
        await _until_up("reading the database's clock", lambda: sample(db, clock), stop)
        watch_clock(metrics.registry, clock)
        async with contextlib.AsyncExitStack() as stack:
            lifecycle.start(stack, "server clock", Every(CLOCK_SAMPLE_S, sampler(db, clock)))
            if traced:
                stack.push_async_callback(
                    lifecycle.bounded,
                    "exporting the last spans",
                    lambda: asyncio.to_thread(tracing.flush),
                )
            flow = FlowGate(
                slots, rates, runs, settings.broker.publisher, settings.ack_wait_s, clock.now
            )
            await Worker(
                settings,
                runs,
                metrics,
                clock=clock.now,
                schedules=ScheduleStore(db[SCHEDULES]),
                flow=flow,
            ).run(stop)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), 5)
    log.info("worker_stopped")
    return 0


async def _until_up(what: str, work: Callable[[], Any], stop: asyncio.Event) -> None:
    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type(PyMongoError),
        wait=wait_exponential_jitter(multiplier=0.2, max=5.0),
        before_sleep=lambda state: log.warning(
            "database_unreachable",
            during=what,
            error=repr(state.outcome.exception() if state.outcome else None),
        ),
    ):
        with attempt:
            if stop.is_set():
                return
            await work()
