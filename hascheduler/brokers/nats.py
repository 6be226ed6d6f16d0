"""NATS JetStream: each fire is a message on ``hascheduler.fire.<target>``, deduplicated
by its ``Nats-Msg-Id`` within the stream's duplicate window, acknowledged once stored."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import nats
import structlog
from nats.js.api import StreamConfig
from nats.js.errors import BadRequestError

from .base import SUBJECT_PREFIX, BrokerUnavailable, FireMessage

log = structlog.get_logger("hascheduler.brokers.nats")

# Publishes awaiting their ack at once (the client's window): a whole burst of claim batches.
PENDING_ACKS = 20_000


class NatsBroker:
    def __init__(self, servers: str, stream: str = "HASCHEDULER",
                 dedup_window_s: float = 600.0) -> None:
        self.servers = servers
        self.stream = stream
        self.dedup_window_s = dedup_window_s
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
                    self._nc = await nats.connect(
                        self.servers, connect_timeout=2, reconnect_time_wait=0.5,
                        max_reconnect_attempts=-1, allow_reconnect=True,
                        error_cb=self._on_error, name="hascheduler")
                js = self._nc.jetstream(publish_async_max_pending=PENDING_ACKS)
                await ensure_stream(js, self.stream, self.dedup_window_s)
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
