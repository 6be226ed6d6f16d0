"""One scheduler replica: MongoDB client, store, mirror and HTTP API, wired and run."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from dataclasses import dataclass

import structlog
from aiohttp import web
from pymongo import AsyncMongoClient
from pymongo.errors import PyMongoError

from .api import create_app
from .constants import DEFAULT_DATABASE, SCHEDULES, STREAM_RETRY_MAX_S
from .mirror import Mirror
from .store import ScheduleStore

log = structlog.get_logger("hascheduler.replica")


@dataclass(frozen=True)
class ReplicaSettings:
    mongodb_uri: str
    http_host: str
    http_port: int
    replica_id: str


async def _ensure_indexes(store: ScheduleStore) -> None:
    """Create indexes, waiting out a database that is not up yet (never crash on it)."""
    delay = 0.2
    while True:
        try:
            await store.ensure_indexes()
            return
        except PyMongoError as exc:
            log.warning("database_unreachable", error=str(exc))
            await asyncio.sleep(delay)
            delay = min(delay * 2, STREAM_RETRY_MAX_S)


async def run_replica(settings: ReplicaSettings, announce: bool = True) -> None:
    """Serve until SIGTERM or SIGINT; prints the API's base URL on one line once listening."""
    structlog.contextvars.bind_contextvars(replica_id=settings.replica_id)
    client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(
        settings.mongodb_uri, tz_aware=True, appname=f"hascheduler/{settings.replica_id}")
    collection = client.get_default_database(DEFAULT_DATABASE)[SCHEDULES]
    store = ScheduleStore(collection)
    mirror = Mirror(collection)
    app = create_app(store, mirror, settings.replica_id)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.http_host, settings.http_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await site.start()
        port = runner.addresses[0][1]
        url = f"http://{settings.http_host}:{port}"
        log.info("replica_listening", url=url)
        if announce:
            print(url, flush=True)
        async with asyncio.TaskGroup() as tasks:
            mirror_task = tasks.create_task(_sync(store, mirror))
            await stop.wait()
            log.info("replica_stopping")
            mirror_task.cancel()
    finally:
        await runner.cleanup()
        await client.close()
        log.info("replica_stopped")


async def _sync(store: ScheduleStore, mirror: Mirror) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        await _ensure_indexes(store)
        await mirror.run()
