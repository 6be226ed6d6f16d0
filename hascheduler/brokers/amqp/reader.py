"""Reading fires back from RabbitMQ (audits). A queue keeps what nobody consumed, so the
audit queue must be bound to every fire before the window it checks
(``bind_audit_queue``: the local cluster binds it when it starts RabbitMQ); reading it
leaves every message in place."""

from __future__ import annotations

import contextlib
import json

import aio_pika

from hascheduler.brokers.base import StoredFire

AUDIT_QUEUE = "hascheduler-dev"


async def bind_audit_queue(url: str, exchange: str = "hascheduler") -> None:
    """A durable queue taking every fire on ``exchange``: without one, every publish would
    come back unroutable (they are mandatory), and it is what an audit reads."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        fires = await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
        queue = await channel.declare_queue(AUDIT_QUEUE, durable=True)
        await queue.bind(fires, "#")
    finally:
        await connection.close()


async def read_queue(url: str, name: str = AUDIT_QUEUE) -> list[bytes]:
    """Every message body in the queue, in order, left in it (each taken, then given back
    once all are read)."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(name, passive=True)
        held = []
        while (message := await queue.get(fail=False)) is not None:
            held.append(message)
        for message in held:
            await message.nack(requeue=True)
        return [m.body for m in held]
    finally:
        await connection.close()


async def read_audit_queue(url: str) -> list[StoredFire]:
    """The fires in the audit queue as events (RabbitMQ does not say when it stored one)."""
    fires = []
    for body in await read_queue(url):
        with contextlib.suppress(ValueError):
            fires.append(StoredFire(json.loads(body), None))
    return fires
