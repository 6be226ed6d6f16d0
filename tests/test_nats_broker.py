"""The NATS broker's publish outcomes against a real nats-server: acknowledged, duplicate,
rejected by JetStream, no stream listening, server gone."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from nats.js.api import DiscardPolicy, StreamConfig

from hascheduler.brokers.base import SUBJECT_PREFIX, BrokerUnavailable, FireMessage
from hascheduler.brokers.nats import NatsBroker, NatsEndpoint, PublishRejected, ack_error
from tests.servers import ServerProcess, start_nats


@pytest.fixture
def nats_server() -> Iterator[ServerProcess]:
    server = start_nats()
    yield server
    server.stop()


@pytest.fixture
async def broker(nats_server: ServerProcess) -> AsyncIterator[NatsBroker]:
    b = NatsBroker(NatsEndpoint.parse(nats_server.uri))
    await b.start()
    yield b
    await b.close()


def messages(n: int, prefix: str = "f", target: str = "t.x") -> list[FireMessage]:
    return [FireMessage(fire_id=f"{prefix}{i}@2030-01-01T00:00:00.000Z", target=target, term=7,
                        body=json.dumps({"i": i}).encode()) for i in range(n)]


async def stream_info(uri: str) -> tuple[int, list[tuple[str, str]]]:
    nc = await nats.connect(uri)
    try:
        js = nc.jetstream()
        info = await js.stream_info("HASCHEDULER")
        first = await js.get_msg("HASCHEDULER", 1)
        assert first.headers is not None
        return info.state.messages, [(first.headers["Nats-Msg-Id"],
                                      first.headers["Hascheduler-Term"])]
    finally:
        await nc.close()


async def test_every_message_is_acknowledged_once_and_a_republish_is_deduplicated(
        broker: NatsBroker, nats_server: ServerProcess) -> None:
    batch = messages(2500)
    assert await broker.publish(batch, 5.0) == [None] * 2500
    # Republished (a new leader adopting claims): acknowledged as duplicates, stored once.
    assert await broker.publish(batch[:1000], 5.0) == [None] * 1000
    stored, headers = await stream_info(nats_server.uri)
    assert stored == 2500
    assert headers == [(batch[0].fire_id, "7")]


async def test_a_message_jetstream_rejects_fails_alone(broker: NatsBroker,
                                                       nats_server: ServerProcess) -> None:
    nc = await nats.connect(nats_server.uri)
    try:  # room for two more messages, then new ones are refused
        await nc.jetstream().update_stream(StreamConfig(
            name="HASCHEDULER", subjects=[f"{SUBJECT_PREFIX}.>"], duplicate_window=600,
            max_msgs=2, discard=DiscardPolicy.NEW))
    finally:
        await nc.close()
    outcomes = await broker.publish(messages(3), 5.0)
    assert outcomes[:2] == [None, None]
    assert isinstance(outcomes[2], PublishRejected)
    assert "maximum messages" in str(outcomes[2])


async def test_no_stream_for_the_subject_is_an_error_not_an_ack(
        broker: NatsBroker, nats_server: ServerProcess) -> None:
    nc = await nats.connect(nats_server.uri)
    try:
        await nc.jetstream().delete_stream("HASCHEDULER")
    finally:
        await nc.close()
    outcomes = await broker.publish(messages(2), 5.0)
    assert all(isinstance(o, PublishRejected) and "503" in str(o) for o in outcomes), outcomes


async def test_server_gone_fails_every_message_within_the_timeout(
        broker: NatsBroker, nats_server: ServerProcess) -> None:
    nats_server.stop()
    outcomes = await broker.publish(messages(3), 1.0)
    assert len(outcomes) == 3
    assert all(isinstance(o, BrokerUnavailable | TimeoutError) for o in outcomes), outcomes


@pytest.mark.parametrize(("data", "headers", "ok"), [
    (b'{"stream":"HASCHEDULER","seq":5}', None, True),
    (b'{"stream":"HASCHEDULER","seq":5,"duplicate":true}', None, True),
    (b'{"stream":"error","seq":5}', None, True),  # "error" only as a stream name
    (b'{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"},'
     b'"stream":"HASCHEDULER","seq":0}', None, False),
    (b"", {"Status": "503"}, False),
    (b"", None, False),
    (b'{"error": not json', None, False),
])
def test_ack_error_reads_jetstream_replies(data: bytes, headers: dict[str, str] | None,
                                           ok: bool) -> None:
    error = ack_error(data, headers)
    assert (error is None) == ok
    if not ok:
        assert isinstance(error, PublishRejected)
        assert str(error)
