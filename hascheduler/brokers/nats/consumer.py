"""Fires from NATS JetStream: a durable pull consumer on the fire stream, shared by every
worker with the same durable name. JetStream does the waiting for ``nak(delay)``,
redelivers after the ack wait, and keeps a message in progress on request.

The pull requests are ours, on nats-py's core publish and subscribe: JetStream's pull
protocol (a request to ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`` asking for a
batch, answered on our inbox) rather than nats-py's ``fetch``, which waits for each
message of a batch with a task and a uuid of its own: a tenth of a busy worker's CPU.
One request is open at a time, for what the worker can take when it is sent; its
messages are handed out as they arrive, so a fetch returns as soon as there is one.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import structlog
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, Header, StatusCode

from hascheduler.brokers.base import SUBJECT_PREFIX, Arrivals
from hascheduler.brokers.nats.publisher import NatsEndpoint, ensure_stream

log = structlog.get_logger("hascheduler.worker")

JS_API = "$JS.API"
# A request the server never ended (its expiry status lost with a reconnect) is taken as
# ended this long after its expiry.
EXPIRY_MARGIN_S = 0.25


async def _disconnected() -> None:
    log.warning("broker_disconnected")


async def _reconnected() -> None:
    log.info("broker_reconnected")


class NatsConsumer:
    pushes = False  # a pull consumer's fetch asks for a batch

    def __init__(self, endpoint: NatsEndpoint) -> None:
        self.endpoint = endpoint
        self._nc: Any = None
        self._inbox_sub: Any = None
        self._inbox = ""
        self._next = ""  # the consumer's pull-request subject
        self._ready: Arrivals[Any] = Arrivals()
        self._left = 0  # messages the open request may still bring
        self._open_until = 0.0  # when it is taken as ended at the latest (monotonic)

    async def connect(self, name: str) -> None:
        self._nc = await self.endpoint.connect(
            name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            disconnected_cb=_disconnected,
            reconnected_cb=_reconnected,
        )

    async def subscribe(
        self, durable: str, patterns: list[str], ack_wait_s: float, in_flight: int
    ) -> None:
        """Creating the stream and the durable consumer if they are gone."""
        js = self._nc.jetstream()
        await ensure_stream(js, self.endpoint)
        subjects = [f"{SUBJECT_PREFIX}.{p}" for p in patterns]
        await js.add_consumer(
            self.endpoint.stream,
            ConsumerConfig(
                durable_name=durable,
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=ack_wait_s,
                max_deliver=-1,
                max_ack_pending=max(1000, 4 * in_flight),
                **(
                    {"filter_subject": subjects[0]}
                    if len(subjects) == 1
                    else {"filter_subjects": subjects}
                ),
            ),
        )
        if self._inbox_sub is not None:  # subscribing again: the old requests are void
            with contextlib.suppress(Exception):
                await self._inbox_sub.unsubscribe()
        self._ready.clear()
        self._left = 0
        self._next = f"{JS_API}.CONSUMER.MSG.NEXT.{self.endpoint.stream}.{durable}"
        self._inbox = self._nc.new_inbox()
        self._inbox_sub = await self._nc.subscribe(self._inbox, cb=self._on_message)

    async def _on_message(self, msg: Any) -> None:
        status = msg.headers.get(Header.STATUS) if msg.headers else None
        if status == StatusCode.CONTROL_MESSAGE:  # a heartbeat: the request goes on
            return
        if status:  # the request ended: expired (408), or the consumer's trouble (409)
            if status not in (StatusCode.REQUEST_TIMEOUT, StatusCode.NO_MESSAGES):
                log.warning(
                    "pull_request_ended",
                    status=status,
                    description=msg.headers.get(Header.DESCRIPTION),
                )
            self._left = 0
        elif self._left > 0 and msg.reply:
            self._ready.put(msg)
            self._left -= 1
        else:
            # Not asked for (anyone may publish to an inbox) or not JetStream's (nothing
            # to acknowledge): dropped, so what waits here stays within the request. A
            # delivery late past its request's end comes again after the ack wait.
            log.debug("pull_message_dropped", subject=str(msg.subject)[:200])

    async def fetch(self, up_to: int, wait_s: float) -> list[Any]:
        now = time.monotonic()
        if not self._ready and (self._left <= 0 or now > self._open_until):
            self._left, self._open_until = up_to, now + wait_s + EXPIRY_MARGIN_S
            request = {"batch": up_to, "expires": int(wait_s * 1e9)}
            await self._nc.publish(self._next, json.dumps(request).encode(), reply=self._inbox)
        await self._ready.wait(wait_s)
        return self._ready.take(up_to)

    async def close(self) -> None:
        # Every message is acknowledged explicitly, so nothing is left to drain from the
        # connection; drain() on a pull subscription can wait forever.
        if self._nc is not None:
            await self._nc.close()
