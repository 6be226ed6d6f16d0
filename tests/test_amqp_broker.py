"""The RabbitMQ broker beyond the contract: its URL and a Celery target's payload taken
apart adversarially (pure), unroutable fires failing, a real RabbitMQ stopped for 10 s
under a firing replica: fires late, none lost; acknowledgements batched (pure, then on a
real RabbitMQ in any order: each delivery settled once, the channel kept)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import random
import re
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import aio_pika
import aiohttp
import pytest

from hascheduler.brokers.amqp import KIND as AMQP
from hascheduler.brokers.amqp.consumer import (
    SETTLE_TURNS,
    Acknowledgements,
    AmqpConsumer,
    binding_key,
    delay_bucket_ms,
)
from hascheduler.brokers.amqp.endpoint import AmqpEndpoint
from hascheduler.brokers.amqp.publisher import AmqpPublisher, Unroutable
from hascheduler.brokers.base import BrokerUnavailable, FireMessage
from hascheduler.brokers.registry import parse_broker_url
from hascheduler.core.celery_message import CeleryPayloadError, celery_call, celery_message
from hascheduler.core.triggers import Interval, fire_id, fire_times
from tests.servers import RabbitServer, start_replica, with_database
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(180)]


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("amqp://", "names no host"),
        ("amqp://h:99999/", "port is not a port number"),
        ("amqp://h/?exchange=", "exchange=''"),
        ("amqp://h/?exchange=amq.topic", "not starting amq."),
        ("amqp://h/?exchange=" + "x" * 256, "1 to 255 characters"),
        ("amqp://h/?celery_queue=", "celery_queue=''"),
        ("amqp://h/?heartbeat=soon", "heartbeat='soon'"),
        ("amqp://h/?replicas=3", "unknown broker URL option(s) replicas"),
        ("rabbit://h/", "unsupported broker URL"),
    ],
)
def test_a_bad_amqp_url_is_refused_naming_the_part(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_broker_url(url)


def test_an_amqp_url_keeps_its_vhost_and_options() -> None:
    endpoint = AmqpEndpoint.parse(
        "amqps://u:p%40ss@rabbit:5671/prod%2Fa?exchange=fires&celery_queue=reports&heartbeat=30"
    )
    assert (endpoint.exchange, endpoint.celery_queue) == ("fires", "reports")
    assert endpoint.display == "rabbit:5671/prod/a"
    assert "p%40ss" in endpoint.url
    assert "u:p" not in endpoint.display
    assert endpoint.url.endswith("?heartbeat=30")
    assert AmqpEndpoint.parse("amqp://h").display == "h:5672//"


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ([1, 2], "payload:"),
        ({"args": {"a": 1}}, "payload.args"),
        ({"args": "one"}, "payload.args"),
        ({"kwargs": [1]}, "payload.kwargs"),
        ({"kwargs": {"not an identifier": 1}}, "payload.kwargs"),
        ({"kwargs": {"1x": 1}}, "payload.kwargs"),
        ({"queue": ""}, "payload.queue"),
        ({"queue": 7}, "payload.queue"),
        ({"queue": "q" * 256}, "payload.queue"),
        ({"args": [], "priority": 9}, "payload.priority"),
    ],
)
def test_a_celery_payload_that_cannot_be_a_call_names_its_field(payload: Any, field: str) -> None:
    with pytest.raises(CeleryPayloadError) as refused:
        celery_call(payload)
    assert str(refused.value).startswith(field)


def test_the_celery_message_bounds_what_monitors_show() -> None:
    call = celery_call({"args": ["x" * 5000], "kwargs": {"k": 1}})
    message = celery_message("proj.tasks.t", "s@2030-01-01T00:00:00.000Z", call, "o")
    assert len(message.headers["argsrepr"]) == 1024
    assert message.headers["kwargsrepr"] == "{'k': 1}"
    assert message.body.startswith(b'[["' + b"x" * 10)


async def test_the_api_refuses_a_celery_payload_naming_the_field(mongo_uri: str) -> None:
    db = f"celery_api_{uuid.uuid4().hex[:8]}"
    replica = start_replica(with_database(mongo_uri, db), "api")
    try:
        async with aiohttp.ClientSession() as http:
            for target, payload, field in [
                ("celery:proj.tasks.t", {"args": "one"}, "payload.args"),
                ("celery:proj.tasks.t", {"kwargs": {"a b": 1}}, "payload.kwargs"),
                ("celery:proj tasks", {}, "target"),
                ("celery:", {}, "target"),
                ("celery:celery:x", {}, "target"),
            ]:
                body = {
                    "name": "c",
                    "target": target,
                    "payload": payload,
                    "trigger": {"kind": "interval", "every": 60},
                }
                async with http.post(replica.uri + "/schedules", json=body) as r:
                    assert r.status == 422, (target, payload, await r.text())
                    assert field in await r.text(), (field, await r.text())
            ok = {
                "name": "c",
                "target": "celery:proj.tasks.t",
                "payload": {"args": [1], "kwargs": {"to": "x"}, "queue": "reports"},
                "trigger": {"kind": "interval", "every": 60},
            }
            async with http.post(replica.uri + "/schedules", json=ok) as r:
                assert r.status == 201, await r.text()
    finally:
        replica.stop()


@pytest.fixture
async def own_rabbit() -> AsyncIterator[RabbitServer]:
    """A node of this test's own: it is stopped and started again."""
    server = RabbitServer().start()
    try:
        yield server
    finally:
        server.close()


async def _audit_queue(url: str, exchange: str) -> tuple[aio_pika.abc.AbstractQueue, Any]:
    connection = await aio_pika.connect(url)
    channel = await connection.channel()
    ex = await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(f"audit-{exchange}", durable=True)
    await queue.bind(ex, "#")
    return queue, connection


@pytest.mark.long(19)
async def test_rabbitmq_stopped_for_ten_seconds_delays_fires_and_loses_none(
    own_rabbit: RabbitServer, mongo_uri: str
) -> None:
    exchange = f"outage-{uuid.uuid4().hex[:6]}"
    url = f"{own_rabbit.url}?exchange={exchange}"
    queue, connection = await _audit_queue(own_rabbit.url, exchange)
    await connection.close()

    # The broker on its own: down, it answers BrokerUnavailable at once; unroutable fails.
    broker = AmqpPublisher(AmqpEndpoint.parse(url))
    await broker.start()
    probe = FireMessage("p@2030-01-01T00:00:00.000Z", "t.x", 1, b"{}")
    assert await broker.publish([probe], 5.0) == [None]
    stray = FireMessage("s@2030-01-01T00:00:00.000Z", "t.x", 1, b"{}")
    unbound = AmqpPublisher(AmqpEndpoint.parse(f"{own_rabbit.url}?exchange=nobody-{exchange}"))
    assert isinstance((await unbound.publish([stray], 5.0))[0], Unroutable)
    await unbound.close()

    db = f"outage_{uuid.uuid4().hex[:8]}"
    replica = start_replica(
        with_database(mongo_uri, db),
        "r",
        "--broker",
        url,
        "--lease-ttl",
        "2",
        "--renew-deadline",
        "1.4",
        "--renew-interval",
        "0.4",
        "--min-fire-interval",
        "0.5",
    )
    try:
        async with aiohttp.ClientSession() as http:
            body = {
                "id": "tick",
                "name": "tick",
                "target": "outage.tick",
                "catchup": "all",
                "trigger": {"kind": "interval", "every": 0.5},
            }
            async with http.post(replica.uri + "/schedules", json=body) as r:
                assert r.status == 201, await r.text()
                schedule = await r.json()
        start_at = dt.datetime.fromisoformat(schedule["trigger"]["start_at"])
        await wait_until(
            lambda: queue_depth(own_rabbit.url, queue.name, 3), 20, "fires before the outage"
        )

        own_rabbit.stop()
        stopped_at = dt.datetime.now(dt.UTC)
        down = await broker.publish([probe], 5.0)
        assert isinstance(down[0], BrokerUnavailable), down
        await wait_until(
            lambda: dt.datetime.now(dt.UTC) > stopped_at + dt.timedelta(seconds=10),
            15,
            "ten seconds of outage",
            interval_s=0.5,
        )
        own_rabbit.start()
        restarted_at = dt.datetime.now(dt.UTC)

        end = restarted_at + dt.timedelta(seconds=2)
        due = {
            fire_id("tick", n)
            for n in fire_times(
                Interval(0.5, start_at), start_at + dt.timedelta(seconds=1), until=end
            )
        }
        assert len(due) >= 25

        async def delivered() -> Counter[str] | None:
            ids = await queue_ids(own_rabbit.url, queue.name)
            return ids if due <= set(ids) else None

        counts = await wait_until(delivered, 30, "every fire due through the outage")
        assert await broker.publish([probe], 5.0) == [None]  # reconnected by itself
    finally:
        replica.stop()
        await broker.close()
    missing = due - set(counts)
    assert not missing
    # The queue is durable and the messages persistent: what was confirmed before the
    # stop survived it. Duplicates are possible (no deduplication) and counted.
    print(f"fires due {len(due)}, copies in the queue {sum(counts[f] for f in due)}")


async def queue_depth(url: str, name: str, at_least: int) -> bool:
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        declared = await channel.declare_queue(name, passive=True)
        return int(declared.declaration_result.message_count or 0) >= at_least
    finally:
        await connection.close()


async def queue_ids(url: str, name: str) -> Counter[str]:
    """Every message_id in the queue, read without consuming (nacked back)."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(name, passive=True)
        counts: Counter[str] = Counter()
        held = []
        while (message := await queue.get(fail=False)) is not None:
            counts[str(message.message_id)] += 1
            held.append(message)
        for message in held:
            await message.nack(requeue=True)
        return counts
    finally:
        await connection.close()


@pytest.mark.parametrize(
    ("delay_s", "ttl_ms"),
    [
        (0, 100),
        (0.05, 100),
        (0.1, 100),
        (0.11, 119),
        (0.4, 400),
        (1, 1132),
        (1.6, 1600),
        (300, 344432),
        (1e9, 1638400),
    ],
)
def test_a_retry_waits_in_the_shortest_delay_queue_at_least_as_long(
    delay_s: float, ttl_ms: int
) -> None:
    assert delay_bucket_ms(delay_s) == ttl_ms
    assert ttl_ms >= min(delay_s * 1000, 1638400)
    assert ttl_ms <= max(100, delay_s * 1000 * 2**0.25 + 1)


@pytest.mark.parametrize(
    ("pattern", "key"),
    [
        (">", "#"),
        ("jobs", "jobs"),
        ("jobs.*", "jobs.*"),
        ("jobs.>", "jobs.*.#"),
        ("a.*.>", "a.*.*.#"),
    ],
)
def test_a_target_pattern_binds_as_nats_would_match(pattern: str, key: str) -> None:
    # NATS's '>' is one or more tokens; AMQP's '#' zero or more: 'jobs.>' must not take
    # 'jobs' itself.
    assert binding_key(pattern) == key


async def test_a_traced_fire_carries_its_trace_context_in_the_headers(rabbit: RabbitServer) -> None:
    exchange = f"traced-{uuid.uuid4().hex[:6]}"
    queue, connection = await _audit_queue(rabbit.url, exchange)
    broker = AmqpPublisher(AmqpEndpoint.parse(f"{rabbit.url}?exchange={exchange}"))
    await broker.start()
    try:
        traced = FireMessage(
            "t@2030-01-01T00:00:00.000Z",
            "t.x",
            1,
            b"{}",
            traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01",
            tracestate="vendor=1",
        )
        plain = FireMessage("p@2030-01-01T00:00:00.000Z", "t.x", 1, b"{}")
        assert await broker.publish([traced, plain], 5.0) == [None, None]
        got = {}
        for _ in range(2):
            message = await wait_until(lambda: queue.get(fail=False), 10, "the fire")
            got[message.message_id] = message.headers
            await message.ack()
    finally:
        await broker.close()
        await connection.close()
    assert (got[traced.fire_id]["traceparent"], got[traced.fire_id]["tracestate"]) == (
        traced.traceparent,
        "vendor=1",
    )
    assert "traceparent" not in got[plain.fire_id]


@pytest.mark.parametrize(
    ("delivered", "acked", "settled", "upto", "alone", "left"),
    [
        ([1, 2, 3], [1, 2, 3], [], 3, [], 0),  # all of them: one frame
        ([1, 2, 3, 4], [1, 2, 4], [], 2, [4], 1),  # 4 does not wait for 3, nor is 3 covered
        ([1, 2, 3, 4], [2, 3], [], None, [2, 3], 2),  # 1 still running: nothing covers it
        ([1, 2, 3, 4], [1, 3, 4], [2], 4, [], 0),  # 2 rejected alone: past it the run goes on
        ([1, 2], [], [], None, [], 2),
        ([5, 9, 12], [5, 9, 12, 13], [], 12, [], 0),  # an unknown tag (13) is nobody's ack
    ],
)
def test_acknowledgements_take_the_run_from_the_oldest_as_one_and_the_rest_alone(
    delivered: list[int],
    acked: list[int],
    settled: list[int],
    upto: int | None,
    alone: list[int],
    left: int,
) -> None:
    acks = Acknowledgements()
    for tag in delivered:
        acks.delivered(tag)
    for tag in settled:
        acks.settled(tag)
    for tag in acked:
        acks.ack(tag)
    assert acks.take() == (upto, alone)
    assert len(acks) == left  # still unsettled
    assert acks.take() == (None, [])  # each taken once


@contextlib.asynccontextmanager
async def queued(
    rabbit: RabbitServer, prefetch: int, fires: int
) -> AsyncIterator[tuple[AmqpConsumer, str]]:
    """A source subscribed with ``prefetch`` on a queue of its own, once ``fires`` fires
    are published to it; the queue's name. Closed (its last acks written) on leaving."""
    prefix = uuid.uuid4().hex[:6]
    target = f"acks.{prefix}"
    url = parse_broker_url(f"{rabbit.url}?exchange=acks-{prefix}")
    source = url.consumer(ack_wait_s=30.0)
    assert isinstance(source, AmqpConsumer)
    durable = f"acks-{prefix}"
    await source.connect(durable)
    try:
        await source.subscribe(durable, [target], 30.0, prefetch)
        publisher = url.publisher()
        await publisher.start()
        try:
            assert (
                await publisher.publish(
                    [
                        FireMessage(
                            f"a{i}@2030-01-01T00:00:00.000Z",
                            target,
                            1,
                            json.dumps({"i": i}).encode(),
                        )
                        for i in range(fires)
                    ],
                    10.0,
                )
                == [None] * fires
            )
        finally:
            await publisher.close()
        yield source, durable
    finally:
        await source.close()


async def fetched(source: AmqpConsumer, n: int) -> list[Any]:
    got: list[Any] = []
    async with asyncio.timeout(20):
        while len(got) < n:
            got += await source.fetch(n, 0.5)
    return got


async def test_acknowledgements_in_any_order_settle_each_delivery_once_on_one_channel(
    rabbit: RabbitServer,
) -> None:
    """300 deliveries acknowledged in a shuffled order, a few at a time, the loop turning
    a random number of times between (a batch's frames are often still being written when
    the next acks come): RabbitMQ closes a channel on a tag acknowledged twice, so the
    channel staying open and the queue ending empty show each ack was sent once."""
    async with queued(rabbit, 300, 300) as (source, durable):
        got = await fetched(source, 300)
        order = random.Random(7)
        order.shuffle(got)
        while got:
            for _ in range(order.randint(1, 6)):
                await got.pop().ack()
                if not got:
                    break
            for _ in range(order.randint(0, 3)):
                await asyncio.sleep(0)  # let the sender write part of a batch
        assert await source.fetch(1, 0.3) == []  # the channel is still open
    # Closed: its last acks were written first.
    connection = await aio_pika.connect(rabbit.url)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(durable, passive=True)
        assert queue.declaration_result.message_count == 0  # none requeued: all acked
    finally:
        await connection.close()


async def test_a_delivery_still_running_holds_back_no_later_acknowledgement(
    rabbit: RabbitServer,
) -> None:
    """With a prefetch of 3, the oldest delivery unacknowledged and the two after it
    acknowledged, RabbitMQ has two places free and sends two more."""
    async with queued(rabbit, 3, 5) as (source, _):
        first = await fetched(source, 3)
        assert len(first) == 3
        for message in first[1:]:
            await message.ack()
        more = await fetched(source, 2)
        assert sorted(json.loads(m.data)["i"] for m in first + more) == [0, 1, 2, 3, 4]


async def test_a_retry_of_a_delivery_whose_channel_closed_is_a_broker_error_and_sends_no_copy(
    rabbit: RabbitServer,
) -> None:
    """A worker's retry (``nak`` with a delay) of a delivery fetched before its channel
    closed (a stalled worker cut off, then subscribed again): RabbitMQ requeued the
    original, so no delayed copy is sent, and the failure is a broker error the worker
    expects (anything else stopped its recorder, and every later run stayed held). The
    original comes back once, and nothing after its delay."""
    async with queued(rabbit, 1, 1) as (source, durable):
        (before,) = await fetched(source, 1)
        target = durable.replace("acks-", "acks.", 1)
        await source.subscribe(durable, [target], 30.0, 1)  # the channel closed, anew
        with pytest.raises(AMQP.errors()):
            await before.nak(delay=0.2)
        (again,) = await fetched(source, 1)
        assert json.loads(again.data) == json.loads(before.data)
        await again.ack()
        assert await source.fetch(1, 1.0) == []  # past the 200 ms delay queue: no copy


async def test_a_retry_whose_copy_cannot_be_sent_goes_back_to_the_queue_at_once(
    rabbit: RabbitServer,
) -> None:
    """The delayed copy fails (its publishing channel closed) while the delivery's own
    channel lives: the original is requeued now, not left there unanswered (holding its
    prefetch place until the connection closes, its retry never made)."""
    async with queued(rabbit, 1, 1) as (source, _):
        (before,) = await fetched(source, 1)
        assert source._publisher is not None
        await source._publisher.close()  # the copy's channel, not the delivery's
        await before.nak(delay=60.0)
        (again,) = await fetched(source, 1)  # at once, not in a minute
        assert json.loads(again.data) == json.loads(before.data)
        await again.ack()


async def test_a_fetch_takes_a_burst_arriving_over_turns_of_the_loop_and_stops_at_a_lull() -> None:
    """What RabbitMQ sends after a batch of acks arrives a frame per turn of the loop: a
    fetch takes all of it once SETTLE_TURNS turns pass with nothing new, not the first
    delivery alone (a claim batch of one, each its own round trip), and a lull that long
    ends the fetch; it never waits past ``up_to``."""
    source = AmqpConsumer(AmqpEndpoint("amqp://127.0.0.1:1/"), heartbeat_s=10)
    source._channel = SimpleNamespace(is_closed=False)  # type: ignore[assignment]
    arrived: Any = source._arrived

    async def arrive(items: range, turns_between: int) -> None:
        for item in items:
            arrived.put(item)
            for _ in range(turns_between):
                await asyncio.sleep(0)

    feeding = asyncio.create_task(arrive(range(10), SETTLE_TURNS - 1))
    assert await source.fetch(100, 5.0) == list(range(10))
    await feeding

    feeding = asyncio.create_task(arrive(range(3), 0))
    await asyncio.sleep(0)
    assert await source.fetch(2, 5.0) == [0, 1]  # up to: no wait for more
    assert await source.fetch(100, 5.0) == [2]
    await feeding

    async def lull() -> None:
        await arrive(range(3), 0)
        for _ in range(SETTLE_TURNS + 8):  # and the turns the fetch takes to wake
            await asyncio.sleep(0)
        await arrive(range(3, 6), 0)

    feeding = asyncio.create_task(lull())
    assert await source.fetch(100, 5.0) == [0, 1, 2]
    await feeding
    assert await source.fetch(100, 5.0) == [3, 4, 5]
