"""The leader's NATS connection for publishing fires and reading their JetStream acks.

nats-py remains the client for everything else (the stream's management, the worker's
consumer); this connection carries only the hot path. nats-py's JetStream publish keeps a
future per message and decodes every ack into an object, and even its core publish and
subscription cost a header-building loop per message and a queue and a task switch per
ack: at 10,000 fires a second that was most of the leader's CPU. Here a publish is one
formatted frame and an ack a slice of the byte stream. It speaks the small part of the
NATS client protocol this needs: INFO, CONNECT (user and password or token from the URL),
TLS upgrade, SUB, HPUB, PING/PONG, MSG and HMSG (status replies such as 503 "no
responders" come as HMSG, to the publishing connection: this one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

import structlog

log = structlog.get_logger("hascheduler.brokers.nats")

# (subject, payload, status or None): the status code of a status reply, e.g. b"503".
Reply = Callable[[bytes, bytes, bytes | None], None]

CONNECT_TIMEOUT_S = 2.0


class WireError(Exception):
    """The connection could not be set up, or broke."""


class Answering(Protocol):
    """Where the frame reader answers the server (a PING's PONG): the connection's writer."""

    def write(self, data: bytes) -> None: ...


class PublishConnection:
    """One connection at a time to one of ``servers`` or of the servers a cluster
    advertises (INFO ``connect_urls``); after a break, the next is tried first."""

    def __init__(
        self,
        servers: list[str],
        tls: ssl.SSLContext | None,
        on_reply: Reply,
        on_lost: Callable[[], None] = lambda: None,
    ) -> None:
        self.servers = servers
        self.tls = tls
        self.on_reply = on_reply
        self.on_lost = on_lost
        self.discovered: list[str] = []
        self.server: str | None = None  # connected to, or last connected to
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self.max_payload = 1 << 20

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self, subject: str) -> None:
        """Subscribe to ``subject`` on the first server that answers; returns once the
        server has registered the subscription. Raises WireError."""
        errors = []
        for server in self.candidates():
            try:
                reader, writer = await asyncio.wait_for(
                    self._open(server, subject), CONNECT_TIMEOUT_S
                )
            except (OSError, TimeoutError, ValueError, ssl.SSLError, WireError) as exc:
                errors.append(f"{server}: {exc!r}")
                continue
            self._writer = writer
            self.server = server
            self._task = asyncio.create_task(self._read(reader, writer))
            return
        raise WireError("; ".join(errors))

    def candidates(self) -> list[str]:
        """Every server known, in order, starting after the one last connected to."""
        known = list(dict.fromkeys([*self.servers, *self.discovered]))
        if self.server in known:
            after = known.index(self.server) + 1
            known = known[after:] + known[:after]
        return known

    def _learn(self, info: dict[str, Any], scheme: str) -> None:
        """The members a server advertises, reached as the configured servers are (the
        same scheme, the same credentials: a cluster shares its accounts)."""
        urls = info.get("connect_urls")
        if isinstance(urls, list):
            auth = urlparse(self.servers[0]).netloc.rpartition("@")[0] if self.servers else ""
            prefix = f"{scheme}://{auth}@" if auth else f"{scheme}://"
            self.discovered = [
                prefix + u for u in urls if isinstance(u, str) and u and not set(u) & set(" @/\r\n")
            ]

    async def _open(
        self, server: str, subject: str
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        url = urlparse(server)
        host, port = url.hostname or "127.0.0.1", url.port or 4222
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        try:
            line = await reader.readline()
            if not line.startswith(b"INFO "):
                raise WireError(f"expected INFO, got {line[:80]!r}")
            info = json.loads(line[5:])
            self.max_payload = int(info.get("max_payload", self.max_payload))
            self._learn(info, url.scheme)
            tls = self.tls
            if tls is None and (info.get("tls_required") or url.scheme == "tls"):
                tls = ssl.create_default_context()
            if tls is not None:
                await writer.start_tls(tls, server_hostname=host)
            options: dict[str, Any] = {
                "verbose": False,
                "pedantic": False,
                "tls_required": tls is not None,
                "name": "hascheduler-publisher",
                "lang": "python",
                "version": "hascheduler",
                "protocol": 1,
                "headers": True,
                "no_responders": True,
            }
            if url.username and url.password is not None:
                options |= {"user": unquote(url.username), "pass": unquote(url.password)}
            elif url.username:
                options["auth_token"] = unquote(url.username)
            writer.write(
                b"CONNECT "
                + json.dumps(options).encode()
                + f"\r\nSUB {subject} 1\r\nPING\r\n".encode()
            )
            await writer.drain()
            while True:  # the PONG: CONNECT and SUB are processed
                line = await reader.readline()
                if line.startswith(b"-ERR"):
                    raise WireError(line.decode(errors="replace").strip())
                if line == b"PONG\r\n":
                    return reader, writer
                if not line:
                    raise WireError("connection closed during the handshake")
        except BaseException:
            writer.close()
            raise

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        buffer = b""
        try:
            while True:
                chunk = await reader.read(1 << 16)
                if not chunk:
                    raise WireError("the server closed the connection")
                buffer = self._frames(buffer + chunk, writer)
        except (OSError, WireError, ValueError) as exc:
            log.warning("nats_publish_connection_lost", server=self.server, error=repr(exc))
        finally:
            writer.close()
            self.on_lost()

    def _frames(self, data: bytes, writer: Answering) -> bytes:
        """Deliver every complete frame in ``data``; returns the incomplete rest."""
        pos = 0
        while True:
            end = data.find(b"\r\n", pos)
            if end < 0:
                return data[pos:]
            head = data[pos:end]
            if head.startswith(b"MSG "):
                # MSG <subject> <sid> [reply-to] <#bytes>
                parts = head.split(b" ")
                start = end + 2
                stop = start + int(parts[-1])
                if len(data) < stop + 2:
                    return data[pos:]
                self.on_reply(parts[1], data[start:stop], None)
                pos = stop + 2
            elif head.startswith(b"HMSG "):
                # HMSG <subject> <sid> [reply-to] <#header bytes> <#total bytes>
                parts = head.split(b" ")
                start = end + 2
                body = start + int(parts[-2])
                stop = start + int(parts[-1])
                if len(data) < stop + 2:
                    return data[pos:]
                # "NATS/1.0 503" (a status reply) or "NATS/1.0" (plain headers)
                status_line = data[start : data.find(b"\r\n", start)].split(b" ")
                self.on_reply(
                    parts[1], data[body:stop], status_line[1] if len(status_line) > 1 else None
                )
                pos = stop + 2
            elif head == b"PING":
                writer.write(b"PONG\r\n")
                pos = end + 2
            elif head.startswith(b"INFO "):  # the cluster's members changed
                with contextlib.suppress(ValueError):
                    info = json.loads(head[5:])
                    if isinstance(info, dict) and self.server:
                        self._learn(info, urlparse(self.server).scheme)
                pos = end + 2
            elif head.startswith((b"PONG", b"+OK")):
                pos = end + 2
            elif head.startswith(b"-ERR"):
                raise WireError(head.decode(errors="replace"))
            else:
                raise WireError(f"unexpected protocol line {head[:80]!r}")

    async def send(self, frames: list[bytes]) -> None:
        """Write publish frames (see frame()); waits while the socket's buffer is full.
        Raises WireError when the connection is down."""
        if self._writer is None or not self.alive:
            raise WireError("not connected")
        self._writer.writelines(frames)
        try:
            await self._writer.drain()
        except (OSError, RuntimeError) as exc:
            raise WireError(repr(exc)) from exc

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._task = None
        self._writer = None


def frame(subject: str, reply: str, headers: str, body: bytes) -> bytes:
    """One HPUB: ``headers`` is the header block's lines, each ending in CRLF. The caller
    vouches that subject, reply and headers hold no whitespace or line breaks where the
    protocol forbids them."""
    head = f"NATS/1.0\r\n{headers}\r\n".encode()
    return b"".join(
        (
            f"HPUB {subject} {reply} {len(head)} {len(head) + len(body)}\r\n".encode(),
            head,
            body,
            b"\r\n",
        )
    )
