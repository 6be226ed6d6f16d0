"""Fires from RabbitMQ: one durable quorum queue per consumer name, bound to the fire
exchange for the worker's target patterns, shared by every worker with that name.

RabbitMQ has no delayed redelivery, so ``nak(delay)`` sends a copy through a delay queue
(a queue-wide TTL that dead-letters back to the consumer's queue) and acknowledges the
original once RabbitMQ confirms the copy; a copy that cannot be sent requeues the
original at once (its early claim is told to wait). The delay queues come in steps of a fourth
root of two from 100 ms (a wait is rounded up to the next one: never shorter than asked,
at most 19 % longer, so a backoff's jitter survives) and every message of one queue has
the same TTL, so none waits behind a longer one. ``term`` rejects the message to the
dead-letter exchange: the consumer's ``.dead`` queue keeps dead runs' messages. An
unacknowledged message is redelivered when its channel closes: a worker killed, or one
whose heartbeats stopped (the connection's heartbeat is a third of the ack wait);
``in_progress`` has nothing to tell RabbitMQ.

Deliveries are consumed on aiormq's channel underneath aio-pika's (aio-pika's message
object and its per-delivery wrapping were a third of a busy worker's receive path), and
acknowledgements leave in batches: the acks asked for in one turn of the loop go out
together, the run of them from the oldest unsettled delivery as one frame (AMQP's
``multiple``), an ack behind a delivery still running on its own, at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from collections.abc import Iterator
from typing import Any

import aio_pika
import aiormq
import structlog
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq.abc import DeliveredMessage

from hascheduler.brokers.amqp.endpoint import AmqpEndpoint
from hascheduler.brokers.base import SUBJECT_PREFIX, Arrivals

# What the client raises when RabbitMQ or the connection fails (the broker kind's errors).
BROKER_ERRORS: tuple[type[BaseException], ...] = (
    aiormq.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
    OSError,
    TimeoutError,
)
TARGET_HEADER = "hascheduler-target"  # a delayed copy's target (its routing key changed)
SUBSCRIBE_TIMEOUT_S = 10.0
SETTLE_TURNS = 3  # turns of the loop without a delivery: the burst has arrived
SHORTEST_DELAY_MS = 100
STEPS_PER_DOUBLING = 4
LONGEST_STEP = 56  # 100 ms * 2 ** 14: 27 min, past any backoff cap

log = structlog.get_logger("hascheduler.brokers.amqp")


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


@contextlib.contextmanager
def _closed_as_connection_error() -> Iterator[None]:
    """aiormq's RuntimeError for a connection closed under a call, as the broker error
    the worker expects of any broker (a ConnectionError)."""
    try:
        yield
    except RuntimeError as exc:
        raise ConnectionError(f"RabbitMQ: {exc}") from exc


class Acknowledgements:
    """The unsettled deliveries of one channel, in delivery order, and which of them are
    to be acknowledged (pure). RabbitMQ's ``multiple`` acknowledges every unsettled
    delivery up to a tag: the run of acknowledged ones from the oldest unsettled takes
    one frame; one behind a delivery still unsettled is acknowledged alone rather than
    waiting for it (it holds a place of the prefetch meanwhile)."""

    def __init__(self) -> None:
        self._unsettled: dict[int, bool] = {}  # delivery tag: its ack asked for

    def __len__(self) -> int:
        return len(self._unsettled)

    def delivered(self, tag: int) -> None:
        self._unsettled[tag] = False

    def ack(self, tag: int) -> None:
        if tag in self._unsettled:
            self._unsettled[tag] = True

    def settled(self, tag: int) -> None:
        """Rejected or requeued on its own: no acknowledgement may cover it."""
        self._unsettled.pop(tag, None)

    def take(self) -> tuple[int | None, list[int]]:
        """The tag to acknowledge with ``multiple`` (None: none), and the tags to
        acknowledge one by one; all of them settled from here on."""
        run = list(itertools.takewhile(self._unsettled.get, self._unsettled))
        alone = [tag for tag, acked in self._unsettled.items() if acked][len(run) :]
        for tag in run + alone:
            del self._unsettled[tag]
        return (run[-1] if run else None), alone


class Consumer:
    """One subscription's channel: its deliveries' settlements, acknowledgements sent
    in batches."""

    def __init__(self, channel: aiormq.abc.AbstractChannel) -> None:
        self.channel = channel
        self.acks = Acknowledgements()
        self._sending: asyncio.Task[None] | None = None

    def ack(self, tag: int) -> None:
        self.acks.ack(tag)
        if self._sending is None:
            self._sending = asyncio.get_running_loop().create_task(self._send())

    async def nack(self, tag: int) -> None:
        self.acks.settled(tag)
        with _closed_as_connection_error():
            await self.channel.basic_nack(tag, requeue=True)

    async def reject(self, tag: int) -> None:
        self.acks.settled(tag)
        with _closed_as_connection_error():
            await self.channel.basic_reject(tag, requeue=False)

    async def _send(self) -> None:
        """The one sender: a multiple ack may cover no tag acknowledged alone before it,
        so the frames of one take are written before the next take (RabbitMQ closes the
        channel on an ack of a tag already acknowledged)."""
        await asyncio.sleep(0)  # the acks the rest of this turn asks for go along
        try:
            while True:
                upto, alone = self.acks.take()
                if upto is None and not alone:
                    return
                if upto is not None:
                    await self.channel.basic_ack(upto, multiple=True)
                for tag in alone:
                    await self.channel.basic_ack(tag)
        except (aiormq.exceptions.AMQPError, RuntimeError, OSError) as exc:
            # The channel is gone: RabbitMQ requeued its unsettled deliveries, and the
            # runs ledger keeps the recorded runs from running again.
            log.info("amqp_acks_lost", error=repr(exc)[:200])
        finally:
            self._sending = None

    async def flushed(self) -> None:
        """Once the acknowledgements asked for so far are written."""
        while self._sending is not None:
            await asyncio.shield(self._sending)


class AmqpDelivery:
    """A RabbitMQ delivery seen as the runtime sees every broker's (runtime.Delivered)."""

    __slots__ = ("consumer", "data", "message", "owner", "subject", "tag", "target")

    def __init__(self, message: DeliveredMessage, consumer: Consumer, owner: AmqpConsumer) -> None:
        self.message = message
        self.consumer = consumer
        self.owner = owner
        headers = message.header.properties.headers or {}
        target = headers.get(TARGET_HEADER) or message.routing_key or ""
        self.target = str(target)
        self.subject = f"{SUBJECT_PREFIX}.{self.target}"
        self.data = message.body
        self.tag: int = message.delivery_tag or 0

    async def ack(self) -> None:
        self.consumer.ack(self.tag)

    async def nak(self, delay: float | None = None) -> None:
        if not delay or delay <= 0:
            await self.consumer.nack(self.tag)
            return
        try:
            await self.owner.delay(self, delay)
        except BROKER_ERRORS as exc:
            if self.consumer.channel.is_closed:
                raise  # RabbitMQ requeued it with its channel
            # No copy sent, on a channel that lives: back in the queue at once, or it
            # would stay there unanswered; a worker claiming it early is told to wait.
            log.warning("amqp_retry_requeued", tag=self.tag, error=repr(exc)[:200])
            await self.consumer.nack(self.tag)
            return
        self.consumer.ack(self.tag)

    async def term(self) -> None:
        await self.consumer.reject(self.tag)

    async def in_progress(self) -> None:
        return None


class AmqpConsumer:
    pushes = True  # up to the consumer's prefetch

    def __init__(self, endpoint: AmqpEndpoint, heartbeat_s: int) -> None:
        self.endpoint = endpoint
        self.heartbeat_s = heartbeat_s
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._publisher: AbstractChannel | None = None
        self._queue = ""
        self._delays: set[int] = set()
        self._consumer: Consumer | None = None
        self._arrived: Arrivals[AmqpDelivery] = Arrivals()

    async def connect(self, name: str) -> None:
        self._connection = await aio_pika.connect(
            self.endpoint.url,
            timeout=10,
            heartbeat=self.heartbeat_s,
            client_properties={"connection_name": name},
        )

    async def subscribe(
        self, durable: str, patterns: list[str], ack_wait_s: float, in_flight: int
    ) -> None:
        # Bounded: a queue without a leader can hold basic.consume unanswered, and the
        # worker must still see its stop between attempts.
        with _closed_as_connection_error():
            async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
                await self._subscribe(durable, patterns, in_flight)

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
        self._arrived.clear()
        self._delays.clear()
        channel = await self._connection.channel()
        await channel.set_qos(prefetch_count=in_flight)
        self._publisher = await self._connection.channel(publisher_confirms=True)
        fires = await channel.declare_exchange(
            self.endpoint.exchange, aio_pika.ExchangeType.TOPIC, durable=True
        )
        dead = await channel.declare_exchange(
            f"{self.endpoint.exchange}.dead", aio_pika.ExchangeType.DIRECT, durable=True
        )
        dead_queue = await channel.declare_queue(
            f"{durable}.dead", durable=True, arguments={"x-queue-type": "quorum"}
        )
        await dead_queue.bind(dead, durable)
        queue = await channel.declare_queue(
            durable,
            durable=True,
            arguments={
                "x-queue-type": "quorum",
                "x-dead-letter-exchange": dead.name,
                "x-dead-letter-routing-key": durable,
            },
        )
        for pattern in patterns:
            await queue.bind(fires, binding_key(pattern))
        self._queue = durable
        self._channel = channel
        consumer = self._consumer = Consumer(await channel.get_underlay_channel())

        async def delivered(message: DeliveredMessage) -> None:
            # aiormq calls this in delivery order: each tag is known before any later
            # one's acknowledgement can cover it.
            delivery = AmqpDelivery(message, consumer, self)
            consumer.acks.delivered(delivery.tag)
            self._arrived.put(delivery)

        await consumer.channel.basic_consume(durable, delivered)

    async def delay(self, delivery: AmqpDelivery, delay_s: float) -> None:
        """A copy of the delivery back in the consumer's queue after ``delay_s`` or a
        little more; returns once RabbitMQ has it. A delivery of a channel that closed
        (RabbitMQ requeued it) gets no copy: a ConnectionError, a broker error as any."""
        channel, publisher = self._channel, self._publisher
        if (
            delivery.consumer is not self._consumer
            or channel is None
            or channel.is_closed
            or publisher is None
        ):
            raise ConnectionError("the RabbitMQ channel of this delivery closed")
        with _closed_as_connection_error():
            await self._publish_delayed(channel, publisher, delivery, delay_s)

    async def _publish_delayed(
        self,
        channel: AbstractChannel,
        publisher: AbstractChannel,
        delivery: AmqpDelivery,
        delay_s: float,
    ) -> None:
        ttl = delay_bucket_ms(delay_s)
        name = f"{self._queue}.delay.{ttl}ms"
        if ttl not in self._delays:
            await channel.declare_queue(
                name,
                durable=True,
                arguments={
                    "x-message-ttl": ttl,
                    "x-dead-letter-exchange": "",
                    "x-dead-letter-routing-key": self._queue,
                },
            )
            self._delays.add(ttl)
        properties = delivery.message.header.properties
        headers = dict(properties.headers or {})
        headers[TARGET_HEADER] = delivery.target
        await publisher.default_exchange.publish(
            aio_pika.Message(
                delivery.data,
                headers=headers,
                message_id=properties.message_id,
                content_type=properties.content_type,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=name,
        )

    async def fetch(self, up_to: int, wait_s: float) -> list[Any]:
        if self._channel is None or self._channel.is_closed:
            raise ConnectionError("the RabbitMQ channel closed")
        if not await self._arrived.wait(wait_s):
            return []
        # What RabbitMQ sends after a batch of acks arrives over several turns of the
        # loop (aiormq reads it a frame at a time): taken once it stops growing, it is
        # one claim's batch rather than a handful each, each its own round trip.
        arrived = self._arrived
        still = 0
        while len(arrived) < up_to and still < SETTLE_TURNS:
            before = len(arrived)
            await asyncio.sleep(0)
            still = still + 1 if len(arrived) == before else 0
        return arrived.take(up_to)

    async def close(self) -> None:
        if self._consumer is not None:
            await self._consumer.flushed()  # the last runs' acks, before the channel goes
        if self._connection is not None:
            with contextlib.suppress(Exception):  # already broken: nothing to close
                await self._connection.close()
