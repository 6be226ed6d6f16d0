"""NATS JetStream: each fire is a message on ``hascheduler.fire.<target>``, deduplicated
by its ``Nats-Msg-Id`` within the stream's duplicate window, acknowledged once stored."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlparse

import nats
import structlog
from nats.js.api import StreamConfig
from nats.js.errors import BadRequestError

from .base import SUBJECT_PREFIX, BrokerUnavailable, FireMessage

log = structlog.get_logger("hascheduler.brokers.nats")

# Publishes awaiting their ack at once (the client's window): a whole burst of claim batches.
PENDING_ACKS = 20_000


TLS_OPTIONS = ("tls_ca_file", "tls_cert_file", "tls_key_file")


@dataclass(frozen=True)
class NatsEndpoint:
    """Where and how to reach NATS, from ``nats://host:port[,host:port]?options`` or
    ``tls://...``. Options: stream, dedup_window (s), tls_ca_file, tls_cert_file and
    tls_key_file (a client certificate for servers that verify clients)."""

    servers: list[str]
    stream: str = "HASCHEDULER"
    dedup_window_s: float = 600.0
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_scheme: bool = False

    @classmethod
    def parse(cls, url: str) -> NatsEndpoint:
        """Raises ValueError naming what is wrong with the URL."""
        parsed = urlparse(url)
        if parsed.scheme not in {"nats", "tls"}:
            raise ValueError(f"{url!r} is not a nats:// or tls:// URL")
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        unknown = set(query) - {"stream", "dedup_window", *TLS_OPTIONS}
        if unknown:
            raise ValueError(f"unknown broker URL option(s) {', '.join(sorted(unknown))}: "
                             f"use stream, dedup_window, {', '.join(TLS_OPTIONS)}")
        window = query.get("dedup_window", "600")
        try:
            dedup_window = float(window)
        except ValueError:
            raise ValueError(f"dedup_window={window!r} in the broker URL is not a number of "
                             "seconds") from None
        if bool(query.get("tls_cert_file")) != bool(query.get("tls_key_file")):
            raise ValueError("tls_cert_file and tls_key_file in the broker URL go together")
        hosts = url.split("?", 1)[0].split("://", 1)[1]
        servers = [f"{parsed.scheme}://{host}" for host in hosts.split(",")]
        endpoint = cls(servers, stream=query.get("stream", "HASCHEDULER"),
                       dedup_window_s=dedup_window, tls_ca_file=query.get("tls_ca_file"),
                       tls_cert_file=query.get("tls_cert_file"),
                       tls_key_file=query.get("tls_key_file"),
                       tls_scheme=parsed.scheme == "tls")
        endpoint.tls_context()  # a missing or unreadable file is a configuration error
        return endpoint

    def tls_context(self) -> ssl.SSLContext | None:
        """None for plain connections. Raises ValueError naming an unusable file."""
        if not (self.tls_scheme or self.tls_ca_file or self.tls_cert_file):
            return None
        try:
            context = ssl.create_default_context(cafile=self.tls_ca_file)
            if self.tls_cert_file:
                context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"TLS files in the broker URL: {exc}") from None
        return context

    async def connect(self, name: str, **options: Any) -> Any:
        tls = self.tls_context()
        if tls is not None:
            options["tls"] = tls
        return await nats.connect(self.servers, name=name, **options)


class NatsBroker:
    def __init__(self, endpoint: NatsEndpoint) -> None:
        self.endpoint = endpoint
        self.servers = ",".join(endpoint.servers)  # for messages
        self.stream = endpoint.stream
        self._nc: Any = None
        self._js: Any = None
        self._connecting = asyncio.Lock()

    async def start(self) -> None:
        try:
            await self._connect()
        except BrokerUnavailable as exc:
            log.warning("broker_unavailable", error=str(exc))

    async def _connect(self) -> Any:
        async with self._connecting:
            if self._js is not None and self._nc is not None and self._nc.is_connected:
                return self._js
            try:
                if self._nc is None or self._nc.is_closed:
                    self._nc = await self.endpoint.connect(
                        "hascheduler", connect_timeout=2, reconnect_time_wait=0.5,
                        max_reconnect_attempts=-1, allow_reconnect=True,
                        error_cb=self._on_error)
                js = self._nc.jetstream(publish_async_max_pending=PENDING_ACKS)
                await ensure_stream(js, self.stream, self.endpoint.dedup_window_s)
            except Exception as exc:
                if self._nc is not None and not self._nc.is_connected:
                    await self._close_quietly()
                raise BrokerUnavailable(f"NATS at {self.servers}: {exc!r}") from exc
            self._js = js
            log.info("broker_connected", servers=self.servers, stream=self.stream)
            return js

    async def _on_error(self, exc: Exception) -> None:
        log.debug("nats_error", error=repr(exc))

    async def publish(self, messages: Sequence[FireMessage],
                      timeout_s: float) -> list[BaseException | None]:
        try:
            js = await asyncio.wait_for(self._connect(), timeout_s)
        except (BrokerUnavailable, TimeoutError) as exc:
            return [exc if isinstance(exc, BrokerUnavailable)
                    else BrokerUnavailable("connecting to NATS timed out")] * len(messages)

        # Pipelined through one shared ack inbox: no task or timer per message (per-message
        # requests cost the leader more CPU than everything else in a burst).
        acks: list[asyncio.Future[Any] | BaseException] = []
        for message in messages:
            try:
                acks.append(await js.publish_async(
                    f"{SUBJECT_PREFIX}.{message.target}", message.body, stream=self.stream,
                    headers={"Nats-Msg-Id": message.fire_id,
                             "Hascheduler-Term": str(message.term)}))
            except Exception as exc:
                acks.append(exc)
        pending = [a for a in acks if isinstance(a, asyncio.Future)]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
        return [_outcome(a) for a in acks]

    async def _close_quietly(self) -> None:
        try:
            await self._nc.close()
        except Exception as exc:  # closing a half-open client may fail in many ways
            log.debug("nats_close_failed", error=repr(exc))
        self._nc = self._js = None

    async def close(self) -> None:
        if self._nc is not None:
            try:
                await self._nc.drain()
            except Exception as exc:
                log.debug("nats_drain_failed", error=repr(exc))
            self._nc = self._js = None


def _outcome(ack: asyncio.Future[Any] | BaseException) -> BaseException | None:
    if isinstance(ack, BaseException):
        return ack
    if not ack.done():
        ack.cancel()  # releases its slot in the client's pending window
    if ack.cancelled():
        return TimeoutError("no acknowledgement from JetStream in time")
    return ack.exception()


async def ensure_stream(js: Any, name: str, dedup_window_s: float) -> None:
    """Create the fire stream if missing (file storage, so fires survive a restart)."""
    config = StreamConfig(name=name, subjects=[f"{SUBJECT_PREFIX}.>"],
                          duplicate_window=dedup_window_s)
    try:
        await js.add_stream(config)
    except BadRequestError:
        await js.update_stream(config)
