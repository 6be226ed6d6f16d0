"""The broker contract (brokers/base.py), run over every broker the project has: a new
broker is proven by adding it to BROKERS and passing these. NATS runs against a real
nats-server; rules that need a server to go away are in test_nats_broker.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import nats
import pytest
import structlog

from hascheduler.brokers.base import Broker, FireMessage
from hascheduler.brokers.log import LogBroker
from hascheduler.brokers.nats import NatsBroker, NatsEndpoint
from tests.servers import start_nats

BROKERS = ["nats", "log"]


@dataclass
class UnderTest:
    broker: Broker
    stored: Callable[[], Awaitable[list[str]]]  # the fire ids the broker holds, in order


@pytest.fixture(params=BROKERS)
async def under_test(request: pytest.FixtureRequest) -> AsyncIterator[UnderTest]:
    if request.param == "nats":
        server = start_nats()
        broker: Broker = NatsBroker(NatsEndpoint.parse(server.uri))

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
            broker = LogBroker()

            async def logged() -> list[str]:
                return [str(e["fire_id"]) for e in logs if e["event"] == "fire"]

            await broker.start()
            try:
                yield UnderTest(broker, logged)
            finally:
                await broker.close()


def fires(n: int, prefix: str = "f", target: str = "t.x") -> list[FireMessage]:
    return [FireMessage(fire_id=f"{prefix}{i}@2030-01-01T00:00:00.000Z", target=target, term=3,
                        body=json.dumps({"data": {"nominal_at": "2030-01-01T00:00:00Z",
                                                  "i": i}}).encode()) for i in range(n)]


async def test_one_outcome_per_message_in_order_each_stored_once(
        under_test: UnderTest) -> None:
    batch = fires(300)
    assert await under_test.broker.publish(batch, 5.0) == [None] * 300
    assert await under_test.stored() == [m.fire_id for m in batch]


async def test_a_republished_fire_is_acknowledged_and_stored_once(
        under_test: UnderTest) -> None:
    batch = fires(20)
    await under_test.broker.publish(batch, 5.0)
    # A new leader republishing claims it adopted: every one acknowledged again.
    assert await under_test.broker.publish([*batch[5:], *fires(2, prefix="g")], 5.0) == \
        [None] * 17
    stored = await under_test.stored()
    assert len(stored) == len(set(stored)) == 22


async def test_a_message_with_an_unusable_target_fails_alone(under_test: UnderTest) -> None:
    batch = [*fires(1), *fires(1, prefix="bad", target="has space"),
             *fires(1, prefix="bad2", target="ends."), *fires(1, prefix="g")]
    outcomes = await under_test.broker.publish(batch, 5.0)
    assert outcomes[0] is None
    assert outcomes[3] is None
    assert all(isinstance(o, Exception) for o in outcomes[1:3]), outcomes
    assert await under_test.stored() == [batch[0].fire_id, batch[3].fire_id]


async def test_an_empty_batch_and_a_body_that_is_not_an_event_are_no_trouble(
        under_test: UnderTest) -> None:
    assert await under_test.broker.publish([], 1.0) == []
    odd = FireMessage("odd@2030-01-01T00:00:00.000Z", "t.x", 1, b"not json")
    assert await under_test.broker.publish([odd], 5.0) == [None]
    assert await under_test.stored() == [odd.fire_id]
