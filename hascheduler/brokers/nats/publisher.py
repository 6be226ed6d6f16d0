"""NATS JetStream: each fire is a message on ``hascheduler.fire.<target>``, deduplicated
by its ``Nats-Msg-Id`` within the stream's duplicate window, acknowledged once stored."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import secrets
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from urllib.parse import parse_qs, urlparse

import nats
import structlog
from nats.js.api import StreamConfig
from nats.js.errors import APIError, BadRequestError

from hascheduler.brokers.base import SUBJECT_PREFIX, BrokerUnavailable, FireMessage
from hascheduler.brokers.nats.wire import PublishConnection, WireError, frame
from hascheduler.core.constants import TARGET_PATTERN
from hascheduler.core.events import FIRED_FIELD_LEN, PreparedEvent

log = structlog.get_logger("hascheduler.brokers.nats")


TLS_OPTIONS = ("tls_ca_file", "tls_cert_file", "tls_key_file")


@dataclass(frozen=True)
class NatsEndpoint:
    """Where and how to reach NATS, from ``nats://host:port[,host:port]?options`` or
    ``tls://...``. Options: stream, dedup_window (s), replicas (of the fire stream, 1-5,
    or auto), tls_ca_file, tls_cert_file and tls_key_file (a client certificate for
    servers that verify clients)."""

    servers: list[str]
    stream: str = "HASCHEDULER"
    dedup_window_s: float = 600.0
    replicas: int | None = None  # of the fire stream; None: 3 where the cluster allows, or 1
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
        unknown = set(query) - {"stream", "dedup_window", "replicas", *TLS_OPTIONS}
        if unknown:
            raise ValueError(
                f"unknown broker URL option(s) {', '.join(sorted(unknown))}: "
                f"use stream, dedup_window, replicas, {', '.join(TLS_OPTIONS)}"
            )
        replicas_text = query.get("replicas", "auto")
        if replicas_text != "auto" and replicas_text not in {"1", "2", "3", "4", "5"}:
            raise ValueError(
                f"replicas={replicas_text!r} in the broker URL: use 1 to 5, or "
                "auto (3 where the cluster has 3 nodes, else 1)"
            )
        window = query.get("dedup_window", "600")
        try:
            dedup_window = float(window)
        except ValueError:
            raise ValueError(
                f"dedup_window={window!r} in the broker URL is not a number of seconds"
            ) from None
        if bool(query.get("tls_cert_file")) != bool(query.get("tls_key_file")):
            raise ValueError("tls_cert_file and tls_key_file in the broker URL go together")
        hosts = url.split("?", 1)[0].split("://", 1)[1]
        servers = [f"{parsed.scheme}://{host}" for host in hosts.split(",")]
        if any(not host.strip() for host in hosts.split(",")):
            raise ValueError(f"{url!r} names an empty server between commas")
        endpoint = cls(
            servers,
            stream=query.get("stream", "HASCHEDULER"),
            dedup_window_s=dedup_window,
            replicas=None if replicas_text == "auto" else int(replicas_text),
            tls_ca_file=query.get("tls_ca_file"),
            tls_cert_file=query.get("tls_cert_file"),
            tls_key_file=query.get("tls_key_file"),
            tls_scheme=parsed.scheme == "tls",
        )
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


@dataclass(eq=False)
class _Batch:
    """One publish call's messages awaiting their JetStream acknowledgements."""

    outcomes: list[BaseException | None]
    waiting: int
    done: asyncio.Event = field(default_factory=asyncio.Event)
    acked: list[bool] = field(default_factory=list)


class StagedFrame(NamedTuple):
    """A fire's HPUB frame built ahead of its due time but for the instant it is fired at
    (``fired``, twice in the event, of FIRED_FIELD_LEN bytes): ``first``, ``fired``,
    ``middle``, ``fired``, ``last`` is the frame. Its reply subject's token is its own, so
    the frame needs nothing of the publish that sends it."""

    token: bytes
    first: bytes
    middle: bytes
    last: bytes
    body_len: int


class NatsPublisher:
    """Publishes fires to JetStream on a PublishConnection (nats_wire.py): one HPUB per
    fire, its reply subject ``<inbox>.<token>`` under the connection's one wildcard
    subscription, each ack settling its message. nats-py manages the stream. The server's
    duplicate detection (``Nats-Msg-Id``) makes a republish safe.

    A fire rendered ahead (PreparedEvent) can be framed ahead too (``stage``): at its
    publish (``publish_staged``) only the instant it is fired at is joined in, for all the
    frames of the publish in one join (10,000 fires due together were late by their
    framing, a microsecond and a half each)."""

    def __init__(self, endpoint: NatsEndpoint) -> None:
        self.endpoint = endpoint
        self.servers = ",".join(endpoint.servers)  # for messages
        self.stream = endpoint.stream
        self._nc: Any = None
        self._ready = False
        self._connecting = asyncio.Lock()
        # Every ack comes to <inbox>.<batch>.<index> on the publishing connection.
        self._inbox = f"_INBOX.{secrets.token_hex(11)}"
        self._reply_prefix = f"{self._inbox}.".encode()
        self._wire = PublishConnection(
            endpoint.servers, endpoint.tls_context(), self._on_reply, self._on_lost
        )
        self._tokens = itertools.count(1)
        self._waiting: dict[bytes, tuple[_Batch, int]] = {}  # reply token -> its message

    async def start(self) -> None:
        try:
            await self._connect()
        except BrokerUnavailable as exc:
            log.warning("broker_unavailable", error=str(exc))

    @property
    def _connected(self) -> bool:
        return self._ready and self._nc is not None and self._nc.is_connected and self._wire.alive

    async def _connect(self) -> Any:
        async with self._connecting:
            if self._connected:
                return self._nc
            try:
                if self._nc is None or self._nc.is_closed:
                    self._nc = await self.endpoint.connect(
                        "hascheduler",
                        connect_timeout=2,
                        reconnect_time_wait=0.5,
                        max_reconnect_attempts=-1,
                        allow_reconnect=True,
                        error_cb=self._on_error,
                    )
                if not self._wire.alive:
                    # Subscribed before anything is published; acks lost while it was
                    # down time out and those fires are retried (deduplicated by the stream).
                    await self._wire.start(f"{self._inbox}.>")
                replicas = await ensure_stream(self._nc.jetstream(), self.endpoint)
            except Exception as exc:
                if self._nc is not None and not self._nc.is_connected:
                    await self._close_quietly()
                raise BrokerUnavailable(f"NATS at {self.servers}: {exc!r}") from exc
            self._ready = True
            log.info(
                "broker_connected",
                servers=self.servers,
                stream=self.stream,
                replicas=replicas,
                publishing_to=self._wire.server,
            )
            return self._nc

    async def _on_error(self, exc: Exception) -> None:
        log.debug("nats_error", error=repr(exc))

    def _on_lost(self) -> None:
        """The publishing connection broke: what it was waiting for will not come on it, so
        those publishes fail now (to be retried on the next connection, deduplicated by the
        stream) rather than at their timeout."""
        lost = BrokerUnavailable("the NATS connection broke before the acknowledgement")
        waiting, self._waiting = self._waiting, {}
        for batch, i in waiting.values():
            if not batch.acked[i]:
                batch.acked[i] = True
                batch.outcomes[i] = lost
                batch.waiting -= 1
                if batch.waiting == 0:
                    batch.done.set()

    def _on_reply(self, subject: bytes, data: bytes, status: bytes | None) -> None:
        waiting = self._waiting.pop(subject[len(self._reply_prefix) :], None)
        if waiting is None:
            return  # the publish call gave up waiting for it (or not a reply of ours)
        batch, i = waiting
        if status == b"503":
            self._ready = False  # no stream for the subject: the next publish ensures it
        batch.acked[i] = True
        batch.outcomes[i] = ack_error(data, status)
        batch.waiting -= 1
        if batch.waiting == 0:
            batch.done.set()

    def stage(self, event: PreparedEvent) -> StagedFrame | None:
        """``event``'s frame but for the instant it is fired at; None when it cannot go on
        the wire as it is (its publish then refuses it)."""
        body_len = len(event.head) + len(event.middle) + len(event.tail) + 2 * FIRED_FIELD_LEN
        if _unsendable(event.target, event.fire_id, body_len, self._wire.max_payload):
            return None
        token = str(next(self._tokens))
        headers = _headers(event.fire_id, event.term, event.traceparent, event.tracestate)
        head = f"NATS/1.0\r\n{headers}\r\n".encode()
        line = (
            f"HPUB {SUBJECT_PREFIX}.{event.target} {self._inbox}.{token} "
            f"{len(head)} {len(head) + body_len}\r\n"
        ).encode()
        return StagedFrame(
            token.encode(), line + head + event.head, event.middle, event.tail + b"\r\n", body_len
        )

    async def publish_staged(
        self, staged: Sequence[StagedFrame], fired: bytes, timeout_s: float
    ) -> list[BaseException | None]:
        """Publish staged frames fired at ``fired`` (``fired_field``); one outcome each, as
        ``publish`` answers."""
        if len(fired) != FIRED_FIELD_LEN:
            raise ValueError(f"a fired field of {len(fired)} bytes, not {FIRED_FIELD_LEN}")
        parts: list[bytes] = []
        tokens: list[bytes] = []
        refused: list[tuple[int, BaseException]] = []
        limit = self._wire.max_payload - 256
        for i, frame_ in enumerate(staged):
            if frame_.body_len > limit:  # a server of a smaller max_payload since staged
                refused.append(
                    (
                        i,
                        PublishRejected(
                            f"message of {frame_.body_len} bytes exceeds the server's max_payload"
                        ),
                    )
                )
                continue
            parts += (frame_.first, fired, frame_.middle, fired, frame_.last)
            tokens.append(frame_.token)
        return await self._send(
            len(staged), tokens, [b"".join(parts)] if parts else [], refused, timeout_s
        )

    async def publish(
        self, messages: Sequence[FireMessage], timeout_s: float
    ) -> list[BaseException | None]:
        frames: list[bytes] = []
        tokens: list[bytes] = []
        refused: list[tuple[int, BaseException]] = []
        for i, message in enumerate(messages):
            problem = _unsendable(
                message.target, message.fire_id, len(message.body), self._wire.max_payload
            )
            if problem is None:
                token = str(next(self._tokens))
                tokens.append(token.encode())
                frames.append(
                    frame(
                        f"{SUBJECT_PREFIX}.{message.target}",
                        f"{self._inbox}.{token}",
                        _headers(
                            message.fire_id, message.term, message.traceparent, message.tracestate
                        ),
                        message.body,
                    )
                )
            else:
                refused.append((i, PublishRejected(problem)))
        return await self._send(len(messages), tokens, frames, refused, timeout_s)

    async def _send(
        self,
        count: int,
        tokens: list[bytes],
        frames: list[bytes],
        refused: list[tuple[int, BaseException]],
        timeout_s: float,
    ) -> list[BaseException | None]:
        """Write ``frames`` (the messages not ``refused``, in order, each acknowledged to
        its token) and await their acks; one outcome per message."""
        try:
            # Connected, a batch goes straight to its write: a wait_for made a task and
            # gave the loop away, so the batches due together were each rendered before
            # the first was written.
            if not self._connected:
                await asyncio.wait_for(self._connect(), timeout_s)
        except (BrokerUnavailable, TimeoutError) as exc:
            return [
                exc
                if isinstance(exc, BrokerUnavailable)
                else BrokerUnavailable("connecting to NATS timed out")
            ] * count
        if not count:
            return []
        timed_out = BrokerUnavailable("no acknowledgement from JetStream in time")
        batch = _Batch(outcomes=[timed_out] * count, waiting=count, acked=[False] * count)
        for i, error in refused:
            batch.acked[i] = True
            batch.outcomes[i] = error
            batch.waiting -= 1
        sent = [i for i, acked in enumerate(batch.acked) if not acked] if refused else range(count)
        waiting = self._waiting
        for token, i in zip(tokens, sent, strict=True):
            waiting[token] = (batch, i)
        try:
            if frames:
                try:
                    # In this task, not a wait_for's: the frames are written now, before
                    # the other batches due together are rendered.
                    async with asyncio.timeout(timeout_s):
                        await self._wire.send(frames)
                except (WireError, TimeoutError) as exc:
                    unavailable = BrokerUnavailable(f"NATS at {self.servers}: {exc!r}")
                    return [
                        unavailable if not done else outcome
                        for done, outcome in zip(batch.acked, batch.outcomes, strict=True)
                    ]
            if batch.waiting:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(batch.done.wait(), timeout_s)
            if frames and batch.waiting == len(tokens):
                # Not one reply: the server may be unreachable without the connection
                # having noticed (it sends no pings of its own). Start afresh next time.
                log.warning("nats_no_replies", messages=len(tokens), timeout_s=timeout_s)
                await self._wire.close()
        finally:
            if batch.waiting:
                for token in tokens:
                    waiting.pop(token, None)
        return batch.outcomes

    async def _close_quietly(self) -> None:
        await self._wire.close()
        try:
            await self._nc.close()
        except Exception as exc:  # closing a half-open client may fail in many ways
            log.debug("nats_close_failed", error=repr(exc))
        self._nc = None
        self._ready = False

    async def close(self) -> None:
        await self._wire.close()
        if self._nc is not None:
            try:
                await self._nc.drain()
            except Exception as exc:
                log.debug("nats_drain_failed", error=repr(exc))
            self._nc = None
            self._ready = False


@functools.lru_cache(maxsize=4096)  # a handful of targets, matched once per fire
def _subject_suffix(target: str) -> bool:
    return TARGET_PATTERN.fullmatch(target) is not None


def _unsendable(target: str, fire_id: str, body_len: int, max_payload: int) -> str | None:
    """Why a message cannot go on the wire as it is, if so. The API validates targets and
    ids; this keeps a document written around it from breaking the protocol's framing."""
    if not _subject_suffix(target):
        return f"target {target!r} is not a valid NATS subject suffix"
    if "\r" in fire_id or "\n" in fire_id:
        return f"fire id {fire_id!r} holds a line break"
    if body_len > max_payload - 256:
        return f"message of {body_len} bytes exceeds the server's max_payload"
    return None


def _headers(fire_id: str, term: int, traceparent: str | None, tracestate: str | None) -> str:
    """A fire's NATS headers: its id for the stream's deduplication, its term, and the W3C
    trace context (rendered by us: no line breaks in them)."""
    lines = f"Nats-Msg-Id: {fire_id}\r\nHascheduler-Term: {term}\r\n"
    if traceparent is not None:
        lines += f"traceparent: {traceparent}\r\n"
        if tracestate:
            lines += f"tracestate: {tracestate}\r\n"
    return lines


class PublishRejected(Exception):
    """JetStream answered a publish with an error (stream missing, limits, ...)."""


def ack_error(data: bytes, status: bytes | None) -> BaseException | None:
    """None for a JetStream ack (a duplicate counts: that fire is stored), else the error:
    BrokerUnavailable when no stream answered, PublishRejected when it refused.

    Acks are ``{"stream":..,"seq":..}``; only an error carries ``"error"``, so the JSON is
    decoded only then. A status reply (``status``, e.g. 503: no stream listens on the
    subject) has no body."""
    if status == b"503":
        # No responders: no stream leader listens on the subject now (an election after
        # its node died, or the stream is missing and is ensured at the next connect).
        return BrokerUnavailable("NATS status 503: no JetStream stream answered")
    if status:
        return PublishRejected(f"NATS status {status.decode(errors='replace')}")
    if b'"error"' not in data:
        return None if data else PublishRejected("empty reply to a JetStream publish")
    try:
        reply = json.loads(data)
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        return PublishRejected(f"unreadable reply to a JetStream publish: {data[:200]!r}")
    error = reply.get("error")
    if not isinstance(error, dict):
        return None  # "error" was only inside a stream name
    return PublishRejected(
        f"JetStream error {error.get('code')} ({error.get('err_code')}): {error.get('description')}"
    )


# JetStream's answers to more replicas than it can place: not clustered, or too few nodes.
REPLICAS_UNAVAILABLE = {10074, 10023}
AUTO_REPLICAS = 3


async def ensure_stream(js: Any, endpoint: NatsEndpoint) -> int:
    """Create the fire stream if missing, or bring its settings to ours (file storage, so
    fires survive a restart); returns its replica count. With replicas unset, 3 where the
    cluster can place them, else 1 (a single server, or too few nodes up: asked again at
    the next connect)."""
    tries = [endpoint.replicas] if endpoint.replicas else [AUTO_REPLICAS, 1]
    for replicas in tries:
        config = StreamConfig(
            name=endpoint.stream,
            subjects=[f"{SUBJECT_PREFIX}.>"],
            duplicate_window=endpoint.dedup_window_s,
            num_replicas=replicas,
        )
        try:
            try:
                await js.add_stream(config)
            except BadRequestError:
                await js.update_stream(config)
            return replicas
        except APIError as exc:
            if replicas == tries[-1] or exc.err_code not in REPLICAS_UNAVAILABLE:
                raise
            log.info("stream_replicas_unavailable", replicas=replicas, error=str(exc.description))
    raise AssertionError("unreachable: the last try returns or raises")
