"""Fixtures: MongoDB-compatible servers in their own processes, and both async drivers.

By default every test talks to the project's development server (``hascheduler devmongo``)
started as a subprocess on a free port. Set HASCHEDULER_TEST_MONGODB_URI to a real MongoDB
replica set started with ``--setParameter enableTestCommands=1`` to run the same tests
against it; tests that need a server started with special options (a tiny change log, a
short cursor timeout) are marked ``devmongo_only`` and are deselected there, and only
there (see ``pytest_collection_modifyitems``).
"""

from __future__ import annotations

import datetime as dt
import gc
import os
import signal
import tempfile
import uuid
from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any

import pytest
import time_machine
from pymongo import MongoClient

from tests.drivers import DRIVERS, Driver
from tests.servers import (
    RabbitServer,
    ServerProcess,
    external_uri,
    free_port,
    start_devmongo,
    start_nats,
    start_replica,
    with_database,
)

# Collecting imports every test module and the libraries they use: with the collector off
# (its collections there freed nothing), and what they built frozen once it is done
# (hascheduler.process.gcpolicy.importing, for the same reason). Off from this import on,
# on again whatever collecting does, in every process (xdist's controller collects
# nothing).
gc.disable()


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Generator[None, object, object]:
    try:
        return (yield)
    finally:
        gc.freeze()
        gc.enable()


# Set by tests/test_time_travel.py: this session's clock starts at that instant and runs on
# (datetime.now and time.time move; the monotonic clock and other processes do not).
TRAVEL_ENV = "HASCHEDULER_TEST_TRAVEL"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "devmongo_only: needs a development server started with special options"
    )
    config.addinivalue_line(
        "markers", "stops_broker: stops its broker, so it needs a RabbitMQ node of its own"
    )
    config.addinivalue_line(
        "markers",
        "alone: asserts how long something takes, or benchmarks; scripts/test runs "
        "these after the others, on an otherwise idle machine",
    )
    config.addinivalue_line(
        "markers",
        "long(seconds): takes about that long here; started first, one to each "
        "parallel process in turn (see long_tests_first)",
    )
    destination = os.environ.get(TRAVEL_ENV)
    if destination:
        time_machine.travel(dt.datetime.fromisoformat(destination), tick=True).start()


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if external_uri() is not None:
        # Against a real MongoDB, tests that start their own development server cannot
        # run. This is the one place tests are deselected, and only when a real server is
        # asked for.
        kept = [i for i in items if i.get_closest_marker("devmongo_only") is None]
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
    long_tests_first(items, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def long_tests_first(items: list[pytest.Item], workers: int) -> None:
    """Order ``items`` so that the tests marked ``long`` start first, spread over the
    workers: pytest-xdist's worksteal mode (scripts/test) hands each worker a contiguous
    block of the collection, of the sizes computed here, and idle workers steal what is
    left. Left in collection order, the longest tests came last and the run ended with
    one or two processes still busy. Each worker's process orders its own collection,
    identically."""

    def seconds(item: pytest.Item) -> float:
        mark = item.get_closest_marker("long")
        return float(mark.args[0]) if mark is not None and mark.args else 0.0

    long = sorted(
        (i for i in items if i.get_closest_marker("long") is not None), key=seconds, reverse=True
    )
    if not long:
        return
    rest = (i for i in items if i.get_closest_marker("long") is None)
    workers = max(workers, 1)
    blocks: list[list[pytest.Item]] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for item in long:  # the longest first, each to the least loaded block
        lightest = load.index(min(load))
        blocks[lightest].append(item)
        load[lightest] += seconds(item)
    ordered: list[pytest.Item] = []
    left = len(items)
    for k, block in enumerate(blocks):
        size = left // (workers - k)  # as worksteal splits the collection
        left -= size
        ordered += block
        ordered += [item for _, item in zip(range(size - len(block)), rest, strict=False)]
    ordered += list(rest)
    items[:] = ordered


@pytest.fixture(scope="session", autouse=True)
def _scratch_in_pytest_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The servers' logs and stores go under this run's pytest directory, which pytest
    prunes (it keeps the last three runs), not loose in /tmp."""
    tempfile.tempdir = str(tmp_path_factory.getbasetemp())
    yield
    tempfile.tempdir = None


@pytest.fixture(scope="session")
def rabbit() -> Iterator[RabbitServer]:
    """One real RabbitMQ node for the session (it takes seconds to start); each test
    names its own exchange and queues."""
    server = RabbitServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def mongo_server() -> Iterator[ServerProcess]:
    uri = external_uri()
    if uri is not None:
        yield ServerProcess(uri, None)
        return
    server = start_devmongo()
    try:
        yield server
    finally:
        assert server.stop() == 0, "devmongo did not stop cleanly on SIGTERM"


@pytest.fixture(scope="session")
def mongo_uri(mongo_server: ServerProcess) -> str:
    return mongo_server.uri


@pytest.fixture(params=sorted(DRIVERS))
def driver(request: pytest.FixtureRequest) -> Driver:
    return DRIVERS[request.param]


@pytest.fixture
async def client(driver: Driver, mongo_uri: str) -> AsyncIterator[Any]:
    c = driver.client(mongo_uri)
    try:
        yield c
    finally:
        await driver.close(c)


@pytest.fixture
def db_name() -> str:
    return f"t_{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def db(client: Any, db_name: str) -> AsyncIterator[Any]:
    database = client[db_name]
    yield database
    await client.drop_database(db_name)


@pytest.fixture
async def own_harness(mongo_uri: str) -> AsyncIterator[Any]:
    """tests/test_failover.py's Harness with a nats-server of its own and no replica
    started yet (for tests that prepare the database before the first replica)."""
    from tests.test_failover import Harness

    server = start_nats()
    h = Harness(mongo_uri, server)
    try:
        await h.record()
        yield h
    finally:
        try:
            await h.close()
        finally:
            server.stop()  # also when close() finds the history broken


API_WRITE_TOKEN, API_READ_TOKEN = "client-write-token", "client-read-token"


class ApiReplica:
    """One replica with a write and a read token, on a port of its own so that it can come
    back on it; its API is what the client and `apply` tests call."""

    def __init__(self, mongo_uri: str, nats: ServerProcess, *args: str) -> None:
        self.db_name = f"api_{uuid.uuid4().hex[:8]}"
        self.mongo_uri = with_database(mongo_uri, self.db_name)
        self.port = free_port()
        self.args = ("--broker", nats.uri, "--http-port", str(self.port), *args)
        self.process = self.start()

    def start(self) -> ServerProcess:
        return start_replica(
            self.mongo_uri,
            f"client-{self.port}",
            *self.args,
            env={
                "HASCHEDULER_WRITE_TOKENS": API_WRITE_TOKEN,
                "HASCHEDULER_READ_TOKENS": API_READ_TOKEN,
            },
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def api_nats() -> Iterator[ServerProcess]:
    server = start_nats()
    yield server
    server.stop()


@pytest.fixture
def api_replica(mongo_uri: str, api_nats: ServerProcess) -> Iterator[ApiReplica]:
    """A replica of its own database, writes unlimited."""
    replica = ApiReplica(mongo_uri, api_nats, "--write-rate", "0")
    try:
        yield replica
    finally:
        replica.process.stop(signal.SIGKILL)
        with MongoClient[dict[str, Any]](mongo_uri) as client:
            client.drop_database(replica.db_name)
