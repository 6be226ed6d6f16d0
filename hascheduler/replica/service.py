"""One scheduler replica: MongoDB client, store, mirror, lease, dispatcher, broker and
HTTP API, wired together and run until SIGTERM (graceful handover) or SIGINT."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import signal
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web
from pymongo.errors import PyMongoError
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from hascheduler.api.access import Access, WriteLimit
from hascheduler.api.access_file import ACCESS_POLL_S, AccessFile
from hascheduler.api.context import Cluster
from hascheduler.api.routes import create_app
from hascheduler.brokers.registry import BrokerUrl
from hascheduler.core.clock import DEFAULT_TOLERANCE_S, ServerClock
from hascheduler.core.constants import (
    AUDIT,
    BACKFILLS,
    CLOCK_SAMPLE_S,
    DEFAULT_DATABASE,
    DEFAULT_MAX_BACKFILL,
    DEFAULT_MIN_FIRE_INTERVAL_S,
    DEFAULT_RUN_RETENTION_S,
    DELIVERIES,
    FIRE_COUNTS,
    FIRES,
    HEALTH_WATCH_INTERVAL_S,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TTL_S,
    LEASE_NAME,
    LEASES,
    MEMBERS,
    RUNS,
    RUNS_WATCH_INTERVAL_S,
    SCHEDULES,
    SLOTS,
    STREAM_RETRY_MAX_S,
    WEBHOOKS,
)
from hascheduler.core.egress import PUBLIC_ONLY, EgressPolicy, address_of
from hascheduler.core.entries import Entry, Written
from hascheduler.core.errors import ConfigError
from hascheduler.core.health import DEFAULT_LATE_AFTER_S, ScheduleHealth
from hascheduler.core.instants import as_utc
from hascheduler.process import lifecycle, logs, tracing
from hascheduler.process.lifecycle import Every
from hascheduler.process.metrics import LOOP_PROBE_S, Metrics, watch_clock
from hascheduler.replica.dispatch import Dispatcher, LeaderStores
from hascheduler.replica.leadership import Elector
from hascheduler.replica.mirror import Mirror
from hascheduler.replica.publishing import DispatchSettings
from hascheduler.replica.tenants import Sources
from hascheduler.replica.webhooks import WebhookDuty, WebhookService
from hascheduler.storage.audit_log import DEFAULT_RETENTION_DAYS, AuditLog
from hascheduler.storage.backfills import Backfills
from hascheduler.storage.driver import connect
from hascheduler.storage.fire_counts import FireCounts
from hascheduler.storage.fires import Ledger
from hascheduler.storage.flow import SlotStore
from hascheduler.storage.health import HealthReader
from hascheduler.storage.lease import Lease, LeaseTimings
from hascheduler.storage.members import Members
from hascheduler.storage.runs import RunLedger
from hascheduler.storage.schedules import ScheduleStore
from hascheduler.storage.server_time import sample, sampler
from hascheduler.storage.tenants import TenantDocuments
from hascheduler.storage.webhooks import Deliveries, WebhookStore

log = structlog.get_logger("hascheduler.replica")

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


@dataclass(frozen=True)
class ReplicaSettings:
    mongodb_uri: str
    http_host: str
    http_port: int
    replica_id: str
    broker: BrokerUrl
    timings: LeaseTimings = field(default_factory=LeaseTimings)
    dispatch: DispatchSettings = field(default_factory=DispatchSettings)
    max_backfill: int = DEFAULT_MAX_BACKFILL  # nominal times one backfill may fire
    # Who may call the API (api/access.py): today's variables and JWTs, and the access
    # file's named tokens and namespace rules, read again when it changes.
    access: Access = field(default_factory=Access)
    access_file: str | None = None
    audit_retention_days: float = DEFAULT_RETENTION_DAYS
    redact_payloads: bool = False  # payload values in the audit trail as digests
    write_limit: WriteLimit = field(default_factory=WriteLimit)
    # The API over HTTPS: a PEM certificate (chain) and its key, both or neither.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    min_fire_interval_s: float = DEFAULT_MIN_FIRE_INTERVAL_S
    run_retention_s: float = DEFAULT_RUN_RETENTION_S
    late_after_s: float = DEFAULT_LATE_AFTER_S  # a fire missing this long: its schedule is late
    trace_url: str | None = None  # the dashboard's link from a run to its trace
    # How well the database's clock must be known to lead (core/clock.py).
    clock_tolerance_s: float = DEFAULT_TOLERANCE_S
    egress: EgressPolicy = PUBLIC_ONLY  # where webhooks may be sent (core/egress.py)
    metrics_need_token: bool = False  # GET /metrics only to a token that may read

    @property
    def listen_host(self) -> str:
        """Without a token, only this host may call the API: never listen beyond it."""
        if self.access.enabled or self.access_file or self.http_host in LOOPBACK_HOSTS:
            return self.http_host
        return "127.0.0.1"


# How long the first database call may take before the replica says it is waiting.
WAITING_SAID_AFTER_S = 1.0


async def _retrying(what: str, work: Callable[[], Awaitable[object]]) -> None:
    """Run ``work()`` until it succeeds, waiting out a database that is not up yet; one
    that has not answered within a second is said to be waited for (a server selection
    takes its full timeout before it fails)."""

    async def say_waiting() -> None:
        await asyncio.sleep(WAITING_SAID_AFTER_S)
        log.warning(
            "database_waiting",
            during=what,
            message="no answer from MongoDB yet: is it running, reachable at the URI's "
            "hosts, and a replica set? (retrying)",
        )

    saying = asyncio.create_task(say_waiting())
    try:
        await _retried(what, work)
    finally:
        saying.cancel()


async def _retried(what: str, work: Callable[[], Awaitable[object]]) -> None:
    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type(PyMongoError),
        wait=wait_exponential(multiplier=0.2, max=STREAM_RETRY_MAX_S),
        before_sleep=lambda state: log.warning(
            "database_unreachable",
            during=what,
            error=str(state.outcome.exception() if state.outcome else None),
        ),
    ):
        with attempt:
            await work()


def _heartbeat(
    members: Members,
    settings: ReplicaSettings,
    url: str,
    mirror: Mirror,
    elector: Elector,
    clock: ServerClock,
) -> Callable[[], Awaitable[None]]:
    """Publish this replica's state for GET /cluster (a TTL index forgets dead ones)."""

    async def beat() -> None:
        with contextlib.suppress(PyMongoError):
            await members.beat(
                settings.replica_id,
                {
                    "url": url,
                    "ready": mirror.ready,
                    "size": mirror.size,
                    "digest": mirror.digest,
                    "leader": elector.is_leader,
                    # The term last seen, as on every log line, so standbys show theirs too.
                    "term": elector.view.term if elector.view is not None else elector.lease.term,
                },
                clock.now(),
            )

    return beat


def _count_runs(
    runs: RunLedger, slots: SlotStore, metrics: Metrics, clock: ServerClock
) -> Callable[[], Awaitable[None]]:
    """Count the running and the stuck runs for /metrics (a read of the running ones only:
    at most each worker's concurrency), and the slots held and runs waiting by key
    template."""
    flow_seen: dict[str, Any] = {"rounds": 0, "in_flight": {}, "waiting": {}}

    async def count() -> None:
        with contextlib.suppress(PyMongoError):
            now = clock.now()
            running: dict[str, int] = {}
            stuck: dict[str, int] = {}
            docs = await runs.running()
            # The flow gauges each round while any key is in use, else every sixth: one
            # read a round is what a replica that no flow limit concerns pays (on a slow
            # link, more reads a round contended with the lease's renewals).
            if flow_seen["in_flight"] or flow_seen["waiting"] or flow_seen["rounds"] % 6 == 0:
                flow_seen["in_flight"] = await slots.in_flight()
                flow_seen["waiting"] = await runs.waiting_counts()
            flow_seen["rounds"] += 1
            in_flight, waiting = flow_seen["in_flight"], flow_seen["waiting"]
            for doc in docs:
                target = str(doc.get("target"))
                running[target] = running.get(target, 0) + 1
                lease_until = as_utc(doc.get("lease_until"))
                if isinstance(lease_until, dt.datetime) and lease_until < now:
                    stuck[target] = stuck.get(target, 0) + 1
            metrics.runs_seen(running, stuck, in_flight, waiting)

    return count


def _judge_health(
    mirror: Mirror,
    store: ScheduleStore,
    health: HealthReader,
    metrics: Metrics,
    clock: ServerClock,
    judged: Callable[[list[ScheduleHealth]], None],
) -> Callable[[], Awaitable[None]]:
    """The health metrics of the schedules that declare an objective (expect), and only
    of those: how many series there are is the operators' choice. Every replica reports
    the same cluster-wide figures, as for the runs gauges."""

    async def judge() -> None:
        declared = sorted(i for i, e in mirror.entries.items() if e.success_within is not None)
        with contextlib.suppress(PyMongoError):  # the series stay as they were until then
            healths = await health.many(await store.get_many(declared), clock.now())
            metrics.health_seen(healths)
            judged(healths)  # the leader's webhooks: schedule.late

    return judge


async def _nothing() -> None:
    pass


class Leadership:
    """The elector as a service: it stands for election once the mirror is in sync (a
    replica whose mirror is not in sync must never lead, invariant 2)."""

    def __init__(self, mirror: Mirror, elector: Elector) -> None:
        self.mirror = mirror
        self.elector = elector
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        ready = asyncio.create_task(self.mirror.wait_ready())
        stopping = asyncio.create_task(self._stopping.wait())
        await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        stopping.cancel()
        if not self._stopping.is_set():
            await self.elector.run()

    def stop(self) -> None:
        self._stopping.set()
        self.elector.stop()


class Replica:
    """One replica's components, built and started in order on an exit stack and stopped
    in reverse: the database client, the broker, the HTTP API, then the background work
    (mirror, election, heartbeats). ``async with Replica(settings) as replica`` runs it
    (in a process or in a test) until the block ends; leaving it hands the lease over.

    Shutdown order, last started first: the elector stops (no new term), the leader hands
    over (stops claiming, drains publishes, releases the lease), the mirror and heartbeats
    stop, the API stops serving, the broker and the database client close. Every step is
    bounded by STOP_STEP_S: a driver call selecting a vanished server does not yield to
    cancellation.
    """

    def __init__(self, settings: ReplicaSettings) -> None:
        self.settings = settings
        self.url = ""
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Replica:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        log.info("replica_stopping")
        await self._stack.aclose()
        log.info("replica_stopped")

    async def _start(self) -> None:  # noqa: PLR0915 (the replica's composition root, one exit stack)
        settings, stack = self.settings, self._stack
        logs.identify(settings.replica_id)
        if tracing.configure("hascheduler"):
            stack.push_async_callback(
                lifecycle.bounded,
                "exporting the last spans",
                lambda: asyncio.to_thread(tracing.flush),
            )
        # The name the database knows this replica's connections by, both clients' (a fail
        # point aimed at the replica covers its renewals too: test_failover.py, bench/chaos.py).
        appname = f"hascheduler/{settings.replica_id}"
        client = connect(settings.mongodb_uri, appname=appname)
        stack.push_async_callback(lifecycle.bounded, "closing the database client", client.close)
        db = client.get_default_database(DEFAULT_DATABASE)
        broker = settings.broker.publisher()
        await broker.start()
        stack.push_async_callback(lifecycle.bounded, "closing the broker", broker.close)

        metrics = Metrics()
        # Every decision on time (a fire due, a lease lapsed, a pause ended) is taken on
        # the database's clock, whatever this host's says (invariant 12).
        self.clock = server_clock = ServerClock(tolerance_s=settings.clock_tolerance_s)
        counts = FireCounts(db[FIRE_COUNTS])
        self.audit = audit = AuditLog(
            db[AUDIT],
            [db[SCHEDULES], db[FIRES], db[RUNS], db[BACKFILLS], db[WEBHOOKS]],
            settings.audit_retention_days,
        )
        store = ScheduleStore(
            db[SCHEDULES], counts, audit, settings.redact_payloads, traced=tracing.write_span
        )
        access = AccessFile(settings.access, settings.access_file)
        ledger = Ledger(db[FIRES])
        runs = RunLedger(db[RUNS])
        members = Members(db[MEMBERS])
        health = HealthReader(ledger, runs, settings.late_after_s)
        webhook_store, deliveries = WebhookStore(db[WEBHOOKS]), Deliveries(db[DELIVERIES])
        # The lease's renewals have a client of their own: in the ledger's pool, a renewal
        # waited for a connection behind the ledger's and the API's traffic, and a slowed
        # link or slow reads made the term lapse between two renewals (test_slow_link.py,
        # test_replica.py). Not queued behind others, their round trips also make the
        # server clock's tightest samples.
        lease_client = connect(settings.mongodb_uri, appname=appname)
        stack.push_async_callback(
            lifecycle.bounded, "closing the lease's database client", lease_client.close
        )
        lease = Lease(
            lease_client.get_default_database(DEFAULT_DATABASE)[LEASES],
            LEASE_NAME,
            settings.replica_id,
            settings.timings,
            server_clock=server_clock,
        )
        dispatcher: Dispatcher | None = None

        self.sources = sources = Sources(db)
        stack.push_async_callback(lifecycle.bounded, "stopping the source mirrors", sources.close)

        def changed(schedule_id: str, entry: Entry | None, written: Written | None) -> None:
            sources.on_change(schedule_id, entry.fan_out if entry is not None else None)
            if dispatcher is not None:
                dispatcher.on_change(schedule_id, entry, written)

        self.mirror = mirror = Mirror(db[SCHEDULES], on_change=changed)
        webhooks = WebhookService(
            webhook_store,
            deliveries,
            ledger,
            runs,
            store,
            mirror.entries,
            server_clock.now,
            settings.egress,
        )
        dispatcher = Dispatcher(
            mirror,
            LeaderStores(ledger, runs, store, counts, Backfills(db[BACKFILLS])),
            broker,
            lease,
            settings.dispatch,
            clock=server_clock.now,
            metrics=metrics,
            sources=sources,
            quota=lambda namespace: access.current.rules_of(namespace).max_fires_per_second,
            services=[WebhookDuty(webhooks)],
        )
        # Leading needs the schedules in sync; a fan-out fire waits for its own source.
        self.elector = elector = Elector(
            lease,
            dispatcher,
            db[LEASES],
            unfit=lambda: (
                server_clock.problem() or (None if mirror.ready else "the mirror is not in sync")
            ),
            metrics=metrics,
            clock=server_clock.now,
        )
        metrics.watch(
            leader=lambda: elector.is_leader,
            term=lambda: elector.view.term if elector.view is not None else 0,
            size=lambda: mirror.size,
            ready=lambda: mirror.ready,
            last_applied=lambda: (
                mirror.last_applied.time if mirror.last_applied is not None else None
            ),
            per_namespace=lambda: dict(
                collections.Counter(e.namespace for e in mirror.entries.values())
            ),
        )
        watch_clock(metrics.registry, server_clock)

        app = create_app(
            store,
            mirror,
            settings.replica_id,
            audit,
            clock=server_clock.now,
            server_clock=server_clock,
            cluster=Cluster(
                db[LEASES],
                members,
                ledger,
                elector,
                runs,
                broker,
                Backfills(db[BACKFILLS]),
                settings.max_backfill,
                health,
                (webhook_store, deliveries),
            ),
            metrics_=metrics,
            access=access,
            write_limit=settings.write_limit,
            min_fire_interval_s=settings.min_fire_interval_s,
            fan_out=(settings.dispatch.max_fan_out, TenantDocuments(db)),
            sources=sources,
            trace_url=settings.trace_url,
            egress=settings.egress,
            metrics_need_token=settings.metrics_need_token,
        )
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        stack.push_async_callback(lifecycle.bounded, "stopping the API", runner.cleanup)
        host = settings.listen_host
        if not access.current.enabled:
            log.warning(
                "api_unauthenticated",
                listening_on=host,
                asked_for=settings.http_host,
                message="no API token configured (--access-file, "
                "HASCHEDULER_WRITE_TOKENS / _FILE, --jwks-file): the API "
                f"serves {host} only, without authentication",
            )
        else:
            log.info("api_access", **access.current.counts())
        tls = api_tls_context(settings.tls_cert_file, settings.tls_key_file)
        await web.TCPSite(runner, host, settings.http_port, ssl_context=tls).start()
        scheme = "https" if tls is not None else "http"
        port = runner.addresses[0][1]
        self.url = f"{scheme}://{host}:{port}"
        # A webhook may never call this replica's own API.
        webhooks.egress = settings.egress.listening(address_of(host), port)
        log.info("replica_listening", url=self.url)

        await _retrying("creating indexes", lambda: _indexes(store, db, settings))
        # One sample before anything stands for election, so the first attempt may lead.
        await _retrying("reading the database's clock", lambda: sample(db, server_clock))
        lifecycle.start(stack, "server clock", Every(CLOCK_SAMPLE_S, sampler(db, server_clock)))
        # Started in this order, stopped in the reverse: the elector first (the leader hands
        # over), then the probes and the heartbeats, leaving GET /cluster at once rather
        # than when the last heartbeat grows stale, then the mirror.
        lifecycle.start(stack, "mirror", mirror)
        lifecycle.start(stack, "audit relay", audit)
        if settings.access_file is not None:

            async def poll_access() -> None:
                before = access.current
                if access.reload_if_changed():
                    await audit.insert(access.changes(before, server_clock.now()))

            lifecycle.start(stack, "access file", Every(ACCESS_POLL_S, poll_access))
        stack.push_async_callback(
            lifecycle.bounded, "leaving the members", lambda: members.leave(settings.replica_id)
        )
        lifecycle.start(
            stack,
            "heartbeat",
            Every(
                HEARTBEAT_INTERVAL_S,
                _heartbeat(members, settings, self.url, mirror, elector, server_clock),
            ),
        )
        lifecycle.start(
            stack,
            "runs watch",
            Every(
                RUNS_WATCH_INTERVAL_S,
                _count_runs(runs, SlotStore(db[SLOTS]), metrics, server_clock),
            ),
        )
        lifecycle.start(stack, "webhooks", webhooks)
        lifecycle.start(
            stack,
            "health watch",
            Every(
                HEALTH_WATCH_INTERVAL_S,
                _judge_health(mirror, store, health, metrics, server_clock, webhooks.judged),
            ),
        )
        lifecycle.start(
            stack, "loop probe", Every(LOOP_PROBE_S, _nothing, late=metrics.loop_lag.observe)
        )
        # Once the elector stopped: the handover (stop claiming, drain publishes, release
        # the lease), bounded by its own steps' limits.
        stack.push_async_callback(elector.shutdown)
        lifecycle.start(stack, "leadership", Leadership(mirror, elector), patient=True)


def api_tls_context(cert_file: str | None, key_file: str | None) -> ssl.SSLContext | None:
    """Tokens travel in a header: off loopback, HTTPS keeps them off the wire."""
    if not cert_file and not key_file:
        return None
    if not (cert_file and key_file):
        raise ConfigError(
            "--tls-cert-file and --tls-key-file (HASCHEDULER_TLS_CERT_FILE / _KEY_FILE) go together"
        )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"--tls-cert-file / --tls-key-file: {exc}") from None
    return context


async def run_replica(settings: ReplicaSettings, announce: bool = True) -> None:
    """``hascheduler serve``: run a replica until SIGTERM (graceful handover) or SIGINT."""
    stop, started = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)

    async def serve() -> None:
        async with Replica(settings) as replica:
            started.set()
            if announce:
                print(replica.url, flush=True)
            await stop.wait()

    serving = asyncio.create_task(serve())
    asked = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, asked}, return_when=asyncio.FIRST_COMPLETED)
    asked.cancel()
    if stop.is_set() and not started.is_set():
        # Asked to stop while starting (a database not up yet is waited for without end):
        # the start is cancelled, and what it started so far is stopped in reverse.
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        log.info("stopped_while_starting")
        return
    await serving  # once started, a stop hands over as the block ends


async def _indexes(store: ScheduleStore, db: Any, settings: ReplicaSettings) -> None:
    await store.ensure_indexes()
    await Ledger(db[FIRES]).ensure_indexes(settings.dispatch.retention_s)
    await RunLedger(db[RUNS]).ensure_indexes(settings.run_retention_s)
    await Backfills(db[BACKFILLS]).ensure_indexes()
    await WebhookStore(db[WEBHOOKS]).ensure_indexes()
    await Deliveries(db[DELIVERIES]).ensure_indexes()
    await AuditLog(
        db[AUDIT],
        [db[SCHEDULES], db[FIRES], db[RUNS], db[BACKFILLS], db[WEBHOOKS]],
        settings.audit_retention_days,
    ).ensure_indexes()
    await Members(db[MEMBERS]).ensure_indexes(HEARTBEAT_TTL_S)
