"""One scheduler replica: MongoDB client, store, mirror, lease, dispatcher, broker and
HTTP API, wired together and run until SIGTERM (graceful handover) or SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import signal
import ssl
import sys
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web
from pymongo import AsyncMongoClient
from pymongo.errors import PyMongoError

from . import logs
from .api import create_app
from .api.access import Tokens, WriteLimit
from .api.app import Cluster
from .brokers import Broker
from .constants import (
    DEFAULT_DATABASE,
    DEFAULT_MIN_FIRE_INTERVAL_S,
    FIRES,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TTL_S,
    LEASE_NAME,
    LEASES,
    MEMBERS,
    SCHEDULES,
    STREAM_RETRY_MAX_S,
)
from .dispatch import Dispatcher, DispatchSettings
from .leadership import Elector
from .lease import Lease, LeaseTimings
from .ledger import Ledger
from .metrics import Metrics
from .mirror import Mirror
from .store import ScheduleStore

log = structlog.get_logger("hascheduler.replica")

# How long each shutdown step may take before we move on.
STOP_STEP_S = 3.0
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


@dataclass(frozen=True)
class ReplicaSettings:
    mongodb_uri: str
    http_host: str
    http_port: int
    replica_id: str
    broker: Broker
    timings: LeaseTimings = field(default_factory=LeaseTimings)
    dispatch: DispatchSettings = field(default_factory=DispatchSettings)
    tokens: Tokens = field(default_factory=Tokens)
    write_limit: WriteLimit = field(default_factory=WriteLimit)
    tls: ssl.SSLContext | None = None  # the API over HTTPS
    min_fire_interval_s: float = DEFAULT_MIN_FIRE_INTERVAL_S

    @property
    def listen_host(self) -> str:
        """Without a token, only this host may call the API: never listen beyond it."""
        if self.tokens.enabled or self.http_host in LOOPBACK_HOSTS:
            return self.http_host
        return "127.0.0.1"


async def _retrying(what: str, work: Any) -> None:
    """Run ``work()`` until it succeeds, waiting out a database that is not up yet."""
    delay = 0.2
    while True:
        try:
            await work()
            return
        except PyMongoError as exc:
            log.warning("database_unreachable", during=what, error=str(exc))
            await asyncio.sleep(delay)
            delay = min(delay * 2, STREAM_RETRY_MAX_S)


async def _heartbeat(members: Any, settings: ReplicaSettings, url: str, mirror: Mirror,
                     elector: Elector, stop: asyncio.Event) -> None:
    """Publish this replica's state for GET /cluster (a TTL index forgets dead ones)."""
    while not stop.is_set():
        with contextlib.suppress(PyMongoError):
            await members.update_one({"_id": settings.replica_id}, {"$set": {
                "url": url, "ready": mirror.ready, "size": mirror.size,
                "digest": mirror.digest, "leader": elector.is_leader,
                # The term last seen, as on every log line, so standbys show theirs too.
                "term": elector.view.term if elector.view is not None else elector.lease.term,
                "seen_at": dt.datetime.now(dt.UTC)}},
                upsert=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), HEARTBEAT_INTERVAL_S)


async def run_replica(settings: ReplicaSettings, announce: bool = True) -> None:
    """Serve until SIGTERM or SIGINT; prints the API's base URL on one line once listening."""
    logs.identify(settings.replica_id)
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        settings.mongodb_uri, tz_aware=True, appname=f"hascheduler/{settings.replica_id}")
    db = client.get_default_database(DEFAULT_DATABASE)
    store = ScheduleStore(db[SCHEDULES])
    lease = Lease(db[LEASES], LEASE_NAME, settings.replica_id, settings.timings)
    mirror = Mirror(db[SCHEDULES])
    metrics = Metrics()
    ledger = Ledger(db[FIRES])
    dispatcher = Dispatcher(mirror, db[SCHEDULES], ledger, settings.broker, lease,
                            settings.dispatch, metrics=metrics)
    mirror.on_change = dispatcher.on_change
    elector = Elector(lease, dispatcher, db[LEASES], ready=lambda: mirror.ready,
                      metrics=metrics)
    metrics.watch(leader=lambda: elector.is_leader,
                  term=lambda: elector.view.term if elector.view is not None else 0,
                  size=lambda: mirror.size, ready=lambda: mirror.ready,
                  last_applied=lambda: (mirror.last_applied.time
                                        if mirror.last_applied is not None else None))
    cluster = Cluster(db[LEASES], db[MEMBERS], ledger, elector)
    app = create_app(store, mirror, settings.replica_id, cluster=cluster, metrics_=metrics,
                     tokens=settings.tokens, write_limit=settings.write_limit,
                     min_fire_interval_s=settings.min_fire_interval_s)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host = settings.listen_host
    if not settings.tokens.enabled:
        log.warning("api_unauthenticated", listening_on=host, asked_for=settings.http_host,
                    message="no API token configured (HASCHEDULER_WRITE_TOKENS / _FILE): "
                            f"the API serves {host} only, without authentication")
    else:
        log.info("api_tokens", read=len(settings.tokens.read), write=len(settings.tokens.write))
    site = web.TCPSite(runner, host, settings.http_port, ssl_context=settings.tls)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    await settings.broker.start()
    try:
        await site.start()
        scheme = "https" if settings.tls is not None else "http"
        url = f"{scheme}://{host}:{runner.addresses[0][1]}"
        log.info("replica_listening", url=url)
        if announce:
            print(url, flush=True)
        await _retrying("creating indexes", lambda: _indexes(store, db, settings))
        tasks = [asyncio.create_task(mirror.run()),
                 asyncio.create_task(_elect_when_ready(mirror, elector)),
                 asyncio.create_task(_heartbeat(db[MEMBERS], settings, url, mirror, elector,
                                                stop))]
        await stop.wait()
        log.info("replica_stopping")
        # The elector first (no new term), then the handover, then the rest. Every wait is
        # bounded: a driver call selecting a vanished server does not yield to cancel().
        elector.stop()
        await asyncio.wait({tasks[1]}, timeout=STOP_STEP_S)
        await elector.shutdown()
        mirror.stop()
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=STOP_STEP_S)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(runner.cleanup(), STOP_STEP_S)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(settings.broker.close(), STOP_STEP_S)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), STOP_STEP_S)
        log.info("replica_stopped")
    stuck = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    if stuck:
        # Tasks that ignore cancellation would make asyncio.run wait forever at exit.
        log.warning("exiting_with_stuck_tasks", tasks=[repr(t.get_coro())
                                                       for t in stuck])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


async def _indexes(store: ScheduleStore, db: Any, settings: ReplicaSettings) -> None:
    await store.ensure_indexes()
    await Ledger(db[FIRES]).ensure_indexes(settings.dispatch.retention_s)
    await db[MEMBERS].create_index("seen_at", name="forget_dead_members",
                                   expireAfterSeconds=int(HEARTBEAT_TTL_S))


async def _elect_when_ready(mirror: Mirror, elector: Elector) -> None:
    """A replica whose mirror is not in sync must never lead (DESIGN invariant 2)."""
    await mirror.wait_ready()
    await elector.run()
