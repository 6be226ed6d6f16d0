"""The broker contract (brokers/base.py), run over every broker the project has: a new
broker is proven by adding it to BROKERS and passing these. NATS and RabbitMQ run against
real servers (RabbitMQ both for its exchange and for Celery task messages); rules that need
a server to go away are in test_nats_broker.py and test_amqp_broker.py."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aio_pika
import nats
import pytest
import structlog

from hascheduler.brokers.amqp.endpoint import AmqpEndpoint
from hascheduler.brokers.amqp.publisher import AmqpPublisher
from hascheduler.brokers.base import Broker, FireMessage
from hascheduler.brokers.log.publisher import LogPublisher
from hascheduler.brokers.nats.publisher import NatsEndpoint, NatsPublisher
from tests.servers import start_nats

BROKERS = ["nats", "log", "amqp", "celery"]


@dataclass
class UnderTest:
    broker: Broker
    stored: Callable[[], Awaitable[list[str]]]  # the fire ids the broker holds, in order
    # RabbitMQ has no deduplication: a republished fire is stored again (and the
    # consumers' runs ledger, or the Celery task's id, keeps the run once).
    deduplicates: bool = True
    prefix: str = ""  # of every target: "celery:" sends Celery tasks


async def _rabbit_queue(
    url: str, exchange: str | None, queue: str
) -> tuple[Callable[[], Awaitable[list[str]]], Any]:
    """A queue that takes what the broker publishes (bound to ``exchange`` for every key,
    or the default exchange's own queue for Celery), and a reader of the fire ids in it
    (each message's ``message_id``; Celery's task id must be the same)."""
    connection = await aio_pika.connect(url)
    channel = await connection.channel()
    declared = await channel.declare_queue(queue, durable=True)
    if exchange is not None:
        ex = await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
        await declared.bind(ex, "#")
    seen: list[str] = []

    async def read() -> list[str]:
        while (message := await declared.get(no_ack=True, fail=False)) is not None:
            assert message.message_id is not None
            if exchange is None:
                assert message.headers["id"] == message.message_id
                assert message.correlation_id == message.message_id
            seen.append(message.message_id)
        return seen

    return read, connection


@pytest.fixture(params=BROKERS)
async def under_test(request: pytest.FixtureRequest) -> AsyncIterator[UnderTest]:
    broker: Broker
    if request.param in {"amqp", "celery"}:
        url = request.getfixturevalue("rabbit").url
        name = f"contract-{uuid.uuid4().hex[:8]}"
        celery = request.param == "celery"
        read, connection = await _rabbit_queue(url, None if celery else name, name)
        broker = AmqpPublisher(AmqpEndpoint.parse(f"{url}?exchange={name}&celery_queue={name}"))
        await broker.start()
        try:
            yield UnderTest(broker, read, deduplicates=False, prefix="celery:" if celery else "")
        finally:
            await broker.close()
            await connection.close()
    elif request.param == "nats":
        server = start_nats()
        broker = NatsPublisher(NatsEndpoint.parse(server.uri))

        async def in_stream() -> list[str]:
            nc = await nats.connect(server.uri)
            try:
                js = nc.jetstream()
                last = (await js.stream_info("HASCHEDULER")).state.last_seq
                ids = []
                for seq in range(1, last + 1):
                    msg = await js.get_msg("HASCHEDULER", seq)
                    assert msg.headers is not None
                    ids.append(msg.headers["Nats-Msg-Id"])
                return ids
            finally:
                await nc.close()

        await broker.start()
        try:
            yield UnderTest(broker, in_stream)
        finally:
            await broker.close()
            server.stop()
    else:
        with structlog.testing.capture_logs() as logs:
            broker = LogPublisher()

            async def logged() -> list[str]:
                return [str(e["fire_id"]) for e in logs if e["event"] == "fire"]

            await broker.start()
            try:
                yield UnderTest(broker, logged)
            finally:
                await broker.close()


def fires(n: int, prefix: str = "f", target: str = "t.x", *, to: str = "") -> list[FireMessage]:
    target = to + target
    return [
        FireMessage(
            fire_id=f"{prefix}{i}@2030-01-01T00:00:00.000Z",
            target=target,
            term=3,
            body=json.dumps({"data": {"nominal_at": "2030-01-01T00:00:00Z", "i": i}}).encode(),
        )
        for i in range(n)
    ]


async def test_one_outcome_per_message_in_order_each_stored_once(under_test: UnderTest) -> None:
    batch = fires(300, to=under_test.prefix)
    assert await under_test.broker.publish(batch, 5.0) == [None] * 300
    assert await under_test.stored() == [m.fire_id for m in batch]


async def test_a_republished_fire_is_acknowledged_and_stored_once(under_test: UnderTest) -> None:
    batch = fires(20, to=under_test.prefix)
    await under_test.broker.publish(batch, 5.0)
    # A new leader republishing claims it adopted: every one acknowledged again.
    again = [*batch[5:], *fires(2, prefix="g", to=under_test.prefix)]
    assert await under_test.broker.publish(again, 5.0) == [None] * 17
    stored = await under_test.stored()
    if under_test.deduplicates:
        assert len(stored) == len(set(stored)) == 22
    else:  # stored again: at least once, each copy under its fire id
        assert stored == [m.fire_id for m in [*batch, *again]]


async def test_a_message_with_an_unusable_target_fails_alone(under_test: UnderTest) -> None:
    to = under_test.prefix
    batch = [
        *fires(1, to=to),
        *fires(1, prefix="bad", target="has space", to=to),
        *fires(1, prefix="bad2", target="ends.", to=to),
        *fires(1, prefix="g", to=to),
    ]
    outcomes = await under_test.broker.publish(batch, 5.0)
    assert outcomes[0] is None
    assert outcomes[3] is None
    assert all(isinstance(o, Exception) for o in outcomes[1:3]), outcomes
    assert await under_test.stored() == [batch[0].fire_id, batch[3].fire_id]


async def test_an_empty_batch_and_a_body_that_is_not_an_event_are_no_trouble(
    under_test: UnderTest,
) -> None:
    assert await under_test.broker.publish([], 1.0) == []
    odd = FireMessage("odd@2030-01-01T00:00:00.000Z", under_test.prefix + "t.x", 1, b"not json")
    outcome = await under_test.broker.publish([odd], 5.0)
    if under_test.prefix == "celery:":
        # A Celery task takes its arguments from the event: without one it fails alone.
        assert isinstance(outcome[0], ValueError), outcome
        assert await under_test.stored() == []
    else:
        assert outcome == [None]
        assert await under_test.stored() == [odd.fire_id]
