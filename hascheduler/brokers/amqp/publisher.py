"""RabbitMQ (AMQP 0-9-1): each fire a persistent message on a durable topic exchange,
routing key the target, ``message_id`` the fire id, confirmed by the broker; a
``celery:<task>`` target becomes a Celery task message on the Celery app's queue instead
(core/celery_message.py).

Every publish is mandatory: a message no queue takes comes back (basic.return) and is a
failed publish, retried and recorded, never a silent success. RabbitMQ has no
deduplication: a fire republished after a failover is stored twice, and the consumers'
claim in the runs ledger (or a Celery task's use of its id) keeps the run exactly once
(docs/FIRING.md).

The connection is made on demand and made again after a loss, at the next publish: the
dispatcher already retries a fire that met an unavailable broker, so a background
reconnect loop (aio-pika's robust connection) would add a second retry schedule without
saving a fire.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Sequence

import aio_pika
import aiormq
import structlog
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange

from hascheduler.brokers.amqp.endpoint import AmqpEndpoint
from hascheduler.brokers.base import BrokerUnavailable, FireMessage
from hascheduler.core.celery_message import (
    CeleryPayloadError,
    celery_call,
    celery_message,
    celery_task,
)
from hascheduler.core.constants import TARGET_PATTERN

log = structlog.get_logger("hascheduler.brokers.amqp")


class Unroutable(Exception):
    """RabbitMQ returned the message: no queue is bound to take it."""


class Refused(BrokerUnavailable):
    """RabbitMQ could not take the message (basic.nack): a quorum queue electing its
    leader, a full queue. Retried as an unavailable broker is."""


class AmqpPublisher:
    """Publishes fires to RabbitMQ with publisher confirms, every message of a batch in
    flight at once (pipelined), each settled by its own ack, nack or return."""

    def __init__(self, endpoint: AmqpEndpoint, origin: str | None = None) -> None:
        self.endpoint = endpoint
        self.origin = origin or f"hascheduler@{socket.gethostname()}"
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchange: AbstractExchange | None = None
        self._default: AbstractExchange | None = None
        self._connecting = asyncio.Lock()

    async def start(self) -> None:
        try:
            await self._ready(5.0)
        except BrokerUnavailable as exc:
            log.warning("broker_unavailable", error=str(exc))

    async def _ready(self, timeout_s: float) -> tuple[AbstractExchange, AbstractExchange]:
        async with self._connecting:
            if (
                self._exchange is not None
                and self._default is not None
                and self._channel is not None
                and not self._channel.is_closed
            ):
                return self._exchange, self._default
            await self._drop()
            try:
                self._connection = await self.endpoint.connect(timeout_s)
                self._channel = await self._connection.channel(
                    publisher_confirms=True, on_return_raises=True
                )
                self._exchange = await self._channel.declare_exchange(
                    self.endpoint.exchange, aio_pika.ExchangeType.TOPIC, durable=True
                )
                self._default = self._channel.default_exchange
            except Exception as exc:
                await self._drop()
                raise BrokerUnavailable(f"RabbitMQ at {self.endpoint.display}: {exc!r}") from exc
            log.info(
                "broker_connected", broker=self.endpoint.display, exchange=self.endpoint.exchange
            )
            return self._exchange, self._default

    async def _drop(self) -> None:
        connection, self._connection = self._connection, None
        self._channel = self._exchange = self._default = None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.close()

    async def publish(
        self, messages: Sequence[FireMessage], timeout_s: float
    ) -> list[BaseException | None]:
        if not messages:
            return []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            exchange, default = await asyncio.wait_for(self._ready(timeout_s), timeout_s)
        except (BrokerUnavailable, TimeoutError) as exc:
            return [
                exc
                if isinstance(exc, BrokerUnavailable)
                else BrokerUnavailable("connecting to RabbitMQ timed out")
            ] * len(messages)
        sends = [asyncio.ensure_future(self._send(m, exchange, default)) for m in messages]
        remaining = max(0.0, deadline - loop.time())
        await asyncio.wait(sends, timeout=remaining)
        outcomes: list[BaseException | None] = []
        lost = False
        for send in sends:
            if not send.done():
                send.cancel()
                outcomes.append(BrokerUnavailable("no confirm from RabbitMQ in time"))
                continue
            outcome = send.result()
            lost = lost or isinstance(outcome, BrokerUnavailable)
            outcomes.append(outcome)
        if lost:
            async with self._connecting:
                await self._drop()
        return outcomes

    async def _send(
        self, message: FireMessage, exchange: AbstractExchange, default: AbstractExchange
    ) -> BaseException | None:
        try:
            task = celery_task(message.target)
            if task is not None:
                if not TARGET_PATTERN.fullmatch(task):
                    return ValueError(f"Celery task name {task!r} is not dot-separated tokens")
                route, body = self._celery(task, message)
                target, key = default, route
            else:
                if not TARGET_PATTERN.fullmatch(message.target):
                    return ValueError(f"target {message.target!r} is not dot-separated tokens")
                body = aio_pika.Message(
                    message.body,
                    message_id=message.fire_id,
                    content_type="application/cloudevents+json",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    headers={"hascheduler-term": message.term, **trace_headers(message)},
                )
                target, key = exchange, message.target
            await target.publish(body, routing_key=key, mandatory=True)
            return None
        except CeleryPayloadError as exc:
            return exc
        except aio_pika.exceptions.PublishError:
            where = (
                f"queue {key!r}"
                if target is default
                else f"exchange {self.endpoint.exchange!r} with routing key {key!r}"
            )
            return Unroutable(f"RabbitMQ returned the message: nothing takes it at {where}")
        except aiormq.exceptions.DeliveryError as exc:
            return Refused(f"RabbitMQ refused the message: {exc!r}")
        except (aiormq.exceptions.AMQPError, ConnectionError, OSError, RuntimeError) as exc:
            return BrokerUnavailable(f"RabbitMQ at {self.endpoint.display}: {exc!r}")

    def _celery(self, task: str, message: FireMessage) -> tuple[str, aio_pika.Message]:
        try:
            event = json.loads(message.body)
            payload = event["data"].get("payload")
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CeleryPayloadError("the fire's body is not an event with a payload") from None
        call = celery_call(payload)
        built = celery_message(task, message.fire_id, call, self.origin)
        return call.queue or self.endpoint.celery_queue, aio_pika.Message(
            built.body,
            headers={**built.headers, **trace_headers(message)},
            correlation_id=built.correlation_id,
            message_id=message.fire_id,
            content_type=built.content_type,
            content_encoding=built.content_encoding,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            priority=0,
        )

    async def close(self) -> None:
        async with self._connecting:
            await self._drop()


def trace_headers(message: FireMessage) -> dict[str, str]:
    """The W3C trace context as AMQP headers (Celery's task headers too, where
    OpenTelemetry's Celery instrumentation looks for it)."""
    headers = {}
    if message.traceparent is not None:
        headers["traceparent"] = message.traceparent
        if message.tracestate:
            headers["tracestate"] = message.tracestate
    return headers
