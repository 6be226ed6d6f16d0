"""Fires from RabbitMQ: one durable quorum queue per consumer name, bound to the fire
exchange for the worker's target patterns, shared by every worker with that name.

RabbitMQ has no delayed redelivery, so ``nak(delay)`` sends a copy through a delay queue
(a queue-wide TTL that dead-letters back to the consumer's queue) and acknowledges the
original once RabbitMQ confirms the copy. The delay queues come in steps of a fourth
root of two from 100 ms (a wait is rounded up to the next one: never shorter than asked,
at most 19 % longer, so a backoff's jitter survives) and every message of one queue has
the same TTL, so none waits behind a longer one. ``term`` rejects the message to the
dead-letter exchange: the consumer's ``.dead`` queue keeps dead runs' messages. An
unacknowledged message is redelivered when its channel closes: a worker killed, or one
whose heartbeats stopped (the connection's heartbeat is a third of the ack wait);
``in_progress`` has nothing to tell RabbitMQ.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage

from hascheduler.brokers.amqp.publisher import AmqpEndpoint
from hascheduler.brokers.base import SUBJECT_PREFIX

TARGET_HEADER = "hascheduler-target"  # a delayed copy's target (its routing key changed)
SUBSCRIBE_TIMEOUT_S = 10.0
SHORTEST_DELAY_MS = 100
STEPS_PER_DOUBLING = 4
LONGEST_STEP = 56  # 100 ms * 2 ** 14: 27 min, past any backoff cap


def delay_bucket_ms(delay_s: float) -> int:
    """The delay queue's TTL for a wait of ``delay_s``: the shortest one at least as long
    (pure)."""
    ratio = max(1.0, delay_s * 1000 / SHORTEST_DELAY_MS)
    step = min(LONGEST_STEP, math.ceil(round(math.log2(ratio) * STEPS_PER_DOUBLING, 9)))
    return math.ceil(SHORTEST_DELAY_MS * 2 ** (step / STEPS_PER_DOUBLING))


def binding_key(pattern: str) -> str:
    """A NATS-style target pattern as an AMQP topic binding: ``*`` is one token in both;
    NATS's last ``>`` (one or more tokens) is AMQP's ``#`` (zero or more), so ``a.>``
    binds ``a.*.#`` and does not take ``a`` itself."""
    if pattern == ">":
        return "#"
    if pattern.endswith(".>"):
        return pattern.removesuffix(">") + "*.#"
    return pattern


class AmqpDelivery:
    """A RabbitMQ delivery seen as the runtime sees every broker's (runtime.Delivered)."""

    def __init__(self, message: AbstractIncomingMessage, source: AmqpSource) -> None:
        self.message = message
        self.source = source
        headers = message.headers or {}
        target = headers.get(TARGET_HEADER) or message.routing_key or ""
        self.target = str(target)
        self.subject = f"{SUBJECT_PREFIX}.{self.target}"
        self.data = message.body

    async def ack(self) -> None:
        await self.message.ack()

    async def nak(self, delay: float | None = None) -> None:
        if not delay or delay <= 0:
            await self.message.nack(requeue=True)
            return
        await self.source.delay(self, delay)
        await self.message.ack()

    async def term(self) -> None:
        await self.message.reject(requeue=False)

    async def in_progress(self) -> None:
        return None


class AmqpSource:
    pushes = True  # up to the consumer's prefetch

    def __init__(self, endpoint: AmqpEndpoint, heartbeat_s: int) -> None:
        self.endpoint = endpoint
        self.heartbeat_s = heartbeat_s
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._publisher: AbstractChannel | None = None
        self._queue = ""
        self._delays: set[int] = set()
        self._arrived: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()

    async def connect(self, name: str) -> None:
        self._connection = await aio_pika.connect(
            self.endpoint.url, timeout=10, heartbeat=self.heartbeat_s,
            client_properties={"connection_name": name})

    async def subscribe(self, durable: str, patterns: list[str], ack_wait_s: float,
                        in_flight: int) -> None:
        try:
            # Bounded: a queue without a leader can hold basic.consume unanswered, and the
            # worker must still see its stop between attempts.
            async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
                await self._subscribe(durable, patterns, in_flight)
        except RuntimeError as exc:  # aiormq's word for a connection closed under us
            raise ConnectionError(f"RabbitMQ: {exc}") from exc

    async def _subscribe(self, durable: str, patterns: list[str], in_flight: int) -> None:
        if self._channel is not None:
            # Subscribing again: the connection failed or is failing; start afresh.
            await self.close()
            self._channel = None
            self._connection = None
        if self._connection is None:
            await self.connect(durable)
        assert self._connection is not None
        # Deliveries of a closed channel were requeued by RabbitMQ: forget ours.
        self._arrived = asyncio.Queue()
        self._delays.clear()
        channel = await self._connection.channel()
        await channel.set_qos(prefetch_count=in_flight)
        self._publisher = await self._connection.channel(publisher_confirms=True)
        fires = await channel.declare_exchange(self.endpoint.exchange,
                                               aio_pika.ExchangeType.TOPIC, durable=True)
        dead = await channel.declare_exchange(f"{self.endpoint.exchange}.dead",
                                              aio_pika.ExchangeType.DIRECT, durable=True)
        dead_queue = await channel.declare_queue(f"{durable}.dead", durable=True,
                                                 arguments={"x-queue-type": "quorum"})
        await dead_queue.bind(dead, durable)
        queue = await channel.declare_queue(durable, durable=True, arguments={
            "x-queue-type": "quorum", "x-dead-letter-exchange": dead.name,
            "x-dead-letter-routing-key": durable})
        for pattern in patterns:
            await queue.bind(fires, binding_key(pattern))
        self._queue = durable
        self._channel = channel
        await queue.consume(self._arrived.put)

    async def delay(self, delivery: AmqpDelivery, delay_s: float) -> None:
        """A copy of the delivery back in the consumer's queue after ``delay_s`` or a
        little more; returns once RabbitMQ has it."""
        assert self._publisher is not None
        assert self._channel is not None
        ttl = delay_bucket_ms(delay_s)
        name = f"{self._queue}.delay.{ttl}ms"
        if ttl not in self._delays:
            await self._channel.declare_queue(name, durable=True, arguments={
                "x-message-ttl": ttl, "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": self._queue})
            self._delays.add(ttl)
        original = delivery.message
        headers = dict(original.headers or {})
        headers[TARGET_HEADER] = delivery.target
        await self._publisher.default_exchange.publish(aio_pika.Message(
            original.body, headers=headers, message_id=original.message_id,
            content_type=original.content_type,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT), routing_key=name)

    async def fetch(self, up_to: int, wait_s: float) -> list[Any]:
        if self._channel is None or self._channel.is_closed:
            raise ConnectionError("the RabbitMQ channel closed")
        try:
            first = await asyncio.wait_for(self._arrived.get(), wait_s)
        except TimeoutError:
            return []
        got = [first]
        while len(got) < up_to and not self._arrived.empty():
            got.append(self._arrived.get_nowait())
        return [AmqpDelivery(m, self) for m in got]

    async def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):  # already broken: nothing to close
                await self._connection.close()
