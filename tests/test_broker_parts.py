"""The rest of the broker contract (brokers/base.py), over every kind in the registry: the
URL picks the kind and only there; a kind with a consumer delivers each fire to a worker
until it is acknowledged; a kind with a reader gives back every fire it holds, leaving
them in place. A new broker is a folder with its KIND and one line in registry.KINDS, and
passes these with its own server started below."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from hascheduler.brokers.amqp.reader import bind_audit_queue
from hascheduler.brokers.base import SUBJECT_PREFIX, FireConsumer, FireMessage
from hascheduler.brokers.registry import KINDS, BrokerUrl, consumable_url, parse_broker_url
from tests.servers import start_nats

# A URL of each kind, on a server the fixture starts ("{}" is its address).
SERVED = {"NATS JetStream": "nats", "RabbitMQ": "amqp", "log": "log"}


def test_every_kind_has_a_served_case_and_each_scheme_one_kind() -> None:
    assert {kind.name for kind in KINDS} == set(SERVED)
    schemes = [scheme for kind in KINDS for scheme in kind.schemes]
    assert len(schemes) == len(set(schemes))


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("nats://127.0.0.1:4222", "NATS JetStream"),
        ("tls://a:1,b:2", "NATS JetStream"),
        ("amqp://u:p@h:5672/v", "RabbitMQ"),
        ("amqps://h/v", "RabbitMQ"),
        ("log:", "log"),
    ],
)
def test_the_scheme_picks_the_kind(url: str, kind: str) -> None:
    parsed = parse_broker_url(url)
    assert (parsed.kind.name, parsed.text, str(parsed)) == (kind, url, url)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("kafka://x", "unsupported broker URL"),
        ("", "unsupported broker URL"),
        ("nats://h:1?nope=1", "unknown broker URL option"),
        ("amqp://h/v?nope=1", "nope"),
    ],
)
def test_a_bad_url_is_refused_naming_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_broker_url(url)


@pytest.mark.parametrize(
    ("url", "message"), [(None, "is required"), ("log:", "log has nothing for a worker to consume")]
)
def test_a_worker_needs_a_kind_it_can_consume_from(url: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        consumable_url(url)
    with pytest.raises(ValueError, match="nothing for a worker"):
        parse_broker_url("log:").consumer(30.0)
    with pytest.raises(ValueError, match="keeps no fires"):
        parse_broker_url("log:").reader()


@pytest.fixture(params=[name for name in SERVED.values() if name != "log"])
async def served(request: pytest.FixtureRequest) -> AsyncIterator[tuple[BrokerUrl, str]]:
    """A broker URL of the kind on a live server, and a target unique to the test."""
    target = f"contract.{uuid.uuid4().hex[:8]}"
    if request.param == "amqp":
        base = request.getfixturevalue("rabbit").url
        exchange = f"parts-{uuid.uuid4().hex[:8]}"
        await bind_audit_queue(base, exchange)
        yield parse_broker_url(f"{base}?exchange={exchange}"), target
        return
    server = start_nats()
    try:
        yield parse_broker_url(server.uri), target
    finally:
        server.stop()


def fire(i: int, target: str) -> FireMessage:
    fire_id = f"parts-{target}-{i}@2030-01-01T00:00:00.000Z"
    event = {"id": fire_id, "data": {"schedule_id": "parts", "i": i}}
    return FireMessage(fire_id, target, 1, json.dumps(event).encode())


async def publish(url: BrokerUrl, messages: list[FireMessage]) -> None:
    publisher = url.publisher()
    await publisher.start()
    try:
        assert await publisher.publish(messages, 10.0) == [None] * len(messages)
    finally:
        await publisher.close()


async def test_the_reader_gives_back_every_fire_and_leaves_them(
    served: tuple[BrokerUrl, str],
) -> None:
    url, target = served
    await publish(url, [fire(i, target) for i in range(3)])
    read = url.reader()
    for _ in range(2):  # reading leaves them in place
        ids = [f.event["id"] for f in await read() if target in str(f.event.get("id"))]
        assert ids == [fire(i, target).fire_id for i in range(3)]


@contextlib.asynccontextmanager
async def subscribed(
    url: BrokerUrl, target: str, ack_wait_s: float, in_flight: int, fires: int
) -> AsyncIterator[FireConsumer]:
    """A source of a consumer of its own on ``target``, once ``fires`` fires are
    published to it."""
    source = url.consumer(ack_wait_s=ack_wait_s)
    await source.connect("contract")
    try:
        await source.subscribe(f"parts-{uuid.uuid4().hex[:8]}", [target], ack_wait_s, in_flight)
        await publish(url, [fire(i, target) for i in range(fires)])
        yield source
    finally:
        await source.close()


async def test_the_source_delivers_each_fire_until_it_is_acknowledged(
    served: tuple[BrokerUrl, str],
) -> None:
    url, target = served
    async with subscribed(url, target, 2.0, 8, 2) as source:
        got: list[Any] = []
        async with asyncio.timeout(20):
            while len(got) < 2:
                got += await source.fetch(2, 0.5)
        assert sorted(m.subject for m in got) == [f"{SUBJECT_PREFIX}.{target}"] * 2
        assert sorted(json.loads(m.data)["data"]["i"] for m in got) == [0, 1]
        await got[0].ack()
        await got[1].nak(delay=0.2)  # comes back; the acknowledged one does not
        again: list[Any] = []
        async with asyncio.timeout(20):
            while not again:
                again += await source.fetch(2, 0.5)
        assert [json.loads(m.data)["data"]["i"] for m in again] == [
            json.loads(got[1].data)["data"]["i"]
        ]
        await again[0].ack()


async def test_a_source_says_whether_its_broker_bounds_what_a_fetch_can_take(
    served: tuple[BrokerUrl, str],
) -> None:
    """``pushes``: a pushing broker delivers no more than ``in_flight`` unacknowledged
    (the worker then claims no further ahead); a pulling one gives a fetch what it asks."""
    url, target = served
    async with subscribed(url, target, 30.0, 2, 5) as source:
        expected = 2 if source.pushes else 5
        got: list[Any] = []
        async with asyncio.timeout(20):
            while len(got) < expected:
                got += await source.fetch(5, 0.5)
        # Nothing past the bound while none is acknowledged: a fetch waits out its wait.
        got += await source.fetch(5, 1.0)
        assert len(got) == expected
        for message in got:
            await message.ack()


async def test_a_fetch_takes_no_more_than_asked_and_an_idle_one_sees_what_comes_later(
    served: tuple[BrokerUrl, str],
) -> None:
    """A fetch returns at most ``up_to``; what it leaves comes with the next fetches, each
    fire once; a fetch that waited out an empty stream still sees fires published after
    (its pull request expired and the next one is made)."""
    url, target = served
    async with subscribed(url, target, 30.0, 10, 5) as source:
        got: list[Any] = []
        async with asyncio.timeout(20):
            while len(got) < 5:
                batch = await source.fetch(2, 0.5)
                assert len(batch) <= 2
                got += batch
        ids = [json.loads(m.data)["data"]["i"] for m in got]
        assert sorted(ids) == [0, 1, 2, 3, 4]
        for message in got:
            await message.ack()
        assert await source.fetch(5, 0.3) == []  # nothing left: the wait is waited out
        assert await source.fetch(5, 0.3) == []
        await publish(url, [fire(i, target) for i in range(5, 8)])
        later: list[Any] = []
        async with asyncio.timeout(20):
            while len(later) < 3:
                later += await source.fetch(5, 0.5)
        assert sorted(json.loads(m.data)["data"]["i"] for m in later) == [5, 6, 7]
        for message in later:
            await message.ack()
