"""The NATS broker's publish outcomes against a real nats-server: acknowledged, duplicate,
rejected by JetStream, stream deleted, unframeable, server gone, password; and the framing of
its own connection."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import signal
import time
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from nats.js.api import DiscardPolicy, StreamConfig

from hascheduler.brokers.base import SUBJECT_PREFIX, BrokerUnavailable, FireMessage
from hascheduler.brokers.nats.publisher import (
    NatsEndpoint,
    NatsPublisher,
    PublishRejected,
    StagedFrame,
    ack_error,
)
from hascheduler.brokers.nats.wire import PublishConnection, WireError, frame
from hascheduler.core.events import EventTemplate, PreparedEvent, fired_field
from tests.servers import ServerProcess, start_nats, stop_process
from tests.waiting import wait_until


@pytest.fixture
def nats_server() -> Iterator[ServerProcess]:
    server = start_nats()
    yield server
    server.stop()


@pytest.fixture
async def broker(nats_server: ServerProcess) -> AsyncIterator[NatsPublisher]:
    b = NatsPublisher(NatsEndpoint.parse(nats_server.uri))
    await b.start()
    yield b
    await b.close()


def messages(n: int, prefix: str = "f", target: str = "t.x") -> list[FireMessage]:
    return [
        FireMessage(
            fire_id=f"{prefix}{i}@2030-01-01T00:00:00.000Z",
            target=target,
            term=7,
            body=json.dumps({"i": i}).encode(),
        )
        for i in range(n)
    ]


async def stream_info(uri: str) -> tuple[int, list[tuple[str, str]]]:
    nc = await nats.connect(uri)
    try:
        js = nc.jetstream()
        info = await js.stream_info("HASCHEDULER")
        first = await js.get_msg("HASCHEDULER", 1)
        assert first.headers is not None
        return info.state.messages, [
            (first.headers["Nats-Msg-Id"], first.headers["Hascheduler-Term"])
        ]
    finally:
        await nc.close()


async def test_every_message_is_acknowledged_once_and_a_republish_is_deduplicated(
    broker: NatsPublisher, nats_server: ServerProcess
) -> None:
    batch = messages(2500)
    assert await broker.publish(batch, 5.0) == [None] * 2500
    # Republished (a new leader adopting claims): acknowledged as duplicates, stored once.
    assert await broker.publish(batch[:1000], 5.0) == [None] * 1000
    stored, headers = await stream_info(nats_server.uri)
    assert stored == 2500
    assert headers == [(batch[0].fire_id, "7")]


async def test_a_connected_publish_writes_its_frames_before_giving_the_loop_away(
    broker: NatsPublisher,
) -> None:
    """Batches due together each start a publish in one turn of the loop: each must write
    its frames in its own first step, or every batch is rendered before any reaches the
    broker (a wait_for around the connection check or the write made a task of its own)."""
    assert await broker.publish(messages(1, "warm"), 5.0) == [None]  # connected
    written: list[int] = []
    send = broker._wire.send

    async def recorded(frames: list[bytes]) -> None:
        written.append(len(frames))
        await send(frames)

    broker._wire.send = recorded  # type: ignore[method-assign]
    publishes = [
        asyncio.create_task(broker.publish(messages(100, f"b{i}-"), 5.0)) for i in range(3)
    ]
    await asyncio.sleep(0)  # one turn: each publish's first step, in order
    assert written == [100, 100, 100]
    assert await asyncio.gather(*publishes) == [[None] * 100] * 3


async def test_a_traced_fire_carries_its_trace_context_in_the_headers(
    broker: NatsPublisher, nats_server: ServerProcess
) -> None:
    traced = messages(1)[0]._replace(
        traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01", tracestate="vendor=1"
    )
    assert await broker.publish([traced, *messages(1, prefix="plain")], 5.0) == [None, None]
    nc = await nats.connect(nats_server.uri)
    try:
        js = nc.jetstream()
        first, second = [await js.get_msg("HASCHEDULER", seq) for seq in (1, 2)]
    finally:
        await nc.close()
    assert first.headers is not None
    assert second.headers is not None
    assert (first.headers["traceparent"], first.headers["tracestate"]) == (
        traced.traceparent,
        "vendor=1",
    )
    assert "traceparent" not in second.headers


async def test_a_message_jetstream_rejects_fails_alone(
    broker: NatsPublisher, nats_server: ServerProcess
) -> None:
    nc = await nats.connect(nats_server.uri)
    try:  # room for two more messages, then new ones are refused
        await nc.jetstream().update_stream(
            StreamConfig(
                name="HASCHEDULER",
                subjects=[f"{SUBJECT_PREFIX}.>"],
                duplicate_window=600,
                max_msgs=2,
                discard=DiscardPolicy.NEW,
            )
        )
    finally:
        await nc.close()
    outcomes = await broker.publish(messages(3), 5.0)
    assert outcomes[:2] == [None, None]
    assert isinstance(outcomes[2], PublishRejected)
    assert "maximum messages" in str(outcomes[2])


async def test_a_deleted_stream_fails_the_batch_and_is_recreated_for_the_retry(
    broker: NatsPublisher, nats_server: ServerProcess
) -> None:
    nc = await nats.connect(nats_server.uri)
    try:
        await nc.jetstream().delete_stream("HASCHEDULER")
    finally:
        await nc.close()
    outcomes = await broker.publish(messages(2), 5.0)
    assert all(isinstance(o, BrokerUnavailable) and "503" in str(o) for o in outcomes), outcomes
    assert await broker.publish(messages(2), 5.0) == [None, None]
    stored, _ = await stream_info(nats_server.uri)
    assert stored == 2


async def test_a_message_that_would_break_the_framing_fails_alone(broker: NatsPublisher) -> None:
    bad = [
        FireMessage("a@x", "has space", 1, b"{}"),
        FireMessage("b\r\n@x", "t", 1, b"{}"),
        FireMessage("c@x", "t", 1, b"x" * (2 << 20)),
    ]
    outcomes = await broker.publish([*messages(1), *bad, *messages(1, prefix="g")], 5.0)
    assert outcomes[0] is None
    assert outcomes[-1] is None
    assert all(isinstance(o, PublishRejected) for o in outcomes[1:-1]), outcomes


async def test_server_gone_fails_every_message_within_the_timeout(
    broker: NatsPublisher, nats_server: ServerProcess
) -> None:
    nats_server.stop()
    outcomes = await broker.publish(messages(3), 1.0)
    assert len(outcomes) == 3
    assert all(isinstance(o, BrokerUnavailable) for o in outcomes), outcomes


async def test_a_stalled_server_times_out_and_a_fresh_connection_publishes_after(
    broker: NatsPublisher, nats_server: ServerProcess
) -> None:
    process = nats_server.process
    assert process is not None
    stop_process(process)
    try:
        outcomes = await broker.publish(messages(3), 1.0)
    finally:
        process.send_signal(signal.SIGCONT)
    assert all(isinstance(o, BrokerUnavailable) for o in outcomes), outcomes
    assert await broker.publish(messages(3, prefix="after"), 5.0) == [None] * 3
    stored, _ = await stream_info(nats_server.uri)
    assert stored in (3, 6)  # the stalled three may have been stored once it resumed


def prepared(
    n: int, prefix: str, target: str = "t.x", trace: dict[str, str] | None = None
) -> list[PreparedEvent]:
    """Fires rendered ahead (Publisher.ready), fired at their publish."""
    due = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    template = EventTemplate.of(
        {"_id": "s", "name": "s", "target": target, "payload": {"k": "v" * 40}}
    )
    return [
        template.prepare(f"{prefix}{i}@2030-01-01T00:00:00.000Z", due, None, 7, 1, trace)
        for i in range(n)
    ]


async def stored_messages(uri: str, count: int) -> list[tuple[dict[str, str], bytes]]:
    nc = await nats.connect(uri)
    try:
        js = nc.jetstream()
        found = [await js.get_msg("HASCHEDULER", seq) for seq in range(1, count + 1)]
    finally:
        await nc.close()
    return [(dict(m.headers or {}), m.data or b"") for m in found]


def staged_of(broker: NatsPublisher, events: list[PreparedEvent]) -> list[StagedFrame]:
    staged = [broker.stage(event) for event in events]
    assert all(frame_ is not None for frame_ in staged)
    return [frame_ for frame_ in staged if frame_ is not None]


async def test_a_fire_framed_ahead_is_stored_as_the_same_message_a_plain_publish_stores(
    broker: NatsPublisher, nats_server: ServerProcess
) -> None:
    """The frames built ahead (``stage``) with the instant joined in at the publish
    (``publish_staged``) carry what ``publish`` sends of the same events: the body, the
    dedup id, the term and the trace context; their acknowledgements come back to them."""
    trace = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "tracestate": "vendor=1"}
    fired = fired_field("2030-01-01T00:00:00.004Z")
    plain = prepared(2, "plain", trace=trace) + prepared(1, "plain-untraced")
    ahead = prepared(2, "ahead", trace=trace) + prepared(1, "ahead-untraced")
    staged = staged_of(broker, ahead)
    assert await broker.publish([event.message(fired) for event in plain], 5.0) == [None] * 3
    assert await broker.publish_staged(staged, fired, 5.0) == [None] * 3
    stored = await stored_messages(nats_server.uri, 6)
    for (plain_headers, plain_body), (ahead_headers, ahead_body), event in zip(
        stored[:3], stored[3:], ahead, strict=True
    ):
        assert ahead_body == event.message(fired).body
        assert json.loads(ahead_body)["time"] == "2030-01-01T00:00:00.004Z"
        assert ahead_headers["Nats-Msg-Id"] == event.fire_id
        assert {k: v for k, v in ahead_headers.items() if k != "Nats-Msg-Id"} == {
            k: v for k, v in plain_headers.items() if k != "Nats-Msg-Id"
        }
        assert plain_body.replace(b"plain", b"ahead") == ahead_body
    assert stored[3][0]["traceparent"] == trace["traceparent"]
    assert "traceparent" not in stored[5][0]
    assert not broker._waiting  # every token answered


async def test_fires_framed_ahead_are_deduplicated_and_refused_one_by_one(
    broker: NatsPublisher, nats_server: ServerProcess
) -> None:
    fired = fired_field("2030-01-01T00:00:00.004Z")
    events = prepared(3, "f")
    assert await broker.publish_staged(staged_of(broker, events), fired, 5.0) == [None] * 3
    # Framed again (a republish): acknowledged as a duplicate, stored once.
    assert await broker.publish_staged(staged_of(broker, events[:1]), fired, 5.0) == [None]
    stored, _ = await stream_info(nats_server.uri)
    assert stored == 3
    # What cannot go on the wire is not framed: its publish refuses it.
    for bad in (
        prepared(1, "a", target="has space"),
        prepared(1, "b\r\n"),
        [dataclasses.replace(prepared(1, "c")[0], tail=b"x" * (2 << 20))],
    ):
        assert broker.stage(bad[0]) is None
        [outcome] = await broker.publish([bad[0].message(fired)], 5.0)
        assert isinstance(outcome, PublishRejected)
    # A frame staged for a server that took larger messages than the one now: refused
    # alone, the others stored.
    events = prepared(3, "g")
    events[1] = dataclasses.replace(events[1], tail=events[1].tail + b" " * 2000)
    staged = staged_of(broker, events)
    broker._wire.max_payload = staged[0].body_len + 256 + 100
    outcomes = await broker.publish_staged(staged, fired, 5.0)
    assert outcomes[0] is None
    assert outcomes[2] is None
    assert isinstance(outcomes[1], PublishRejected)
    with pytest.raises(ValueError, match="fired field"):
        await broker.publish_staged(staged, b'"2030"', 5.0)


async def test_fires_framed_ahead_for_a_server_gone_fail_within_the_timeout(
    broker: NatsPublisher, nats_server: ServerProcess
) -> None:
    staged = staged_of(broker, prepared(3, "f"))
    nats_server.stop()
    outcomes = await broker.publish_staged(staged, fired_field("2030-01-01T00:00:00.004Z"), 1.0)
    assert len(outcomes) == 3
    assert all(isinstance(o, BrokerUnavailable) for o in outcomes), outcomes
    assert not broker._waiting


async def test_a_connection_that_breaks_while_acks_are_awaited_fails_them_at_once(
    broker: NatsPublisher, nats_server: ServerProcess
) -> None:
    """Frames written, their acks awaited, and the server dies: every fire awaiting an ack
    on that connection, framed ahead or not, fails then (BrokerUnavailable: retried on the
    next connection, deduplicated by the stream), not at its timeout, and no token is left
    waiting."""
    assert await broker.publish(messages(1, "warm"), 5.0) == [None]  # connected
    staged = staged_of(broker, prepared(2, "s"))
    process = nats_server.process
    assert process is not None
    stop_process(process)  # the frames reach its socket; no ack comes back
    started = time.monotonic()
    pending = [
        asyncio.create_task(broker.publish(messages(2, "m"), 30.0)),
        asyncio.create_task(
            broker.publish_staged(staged, fired_field("2030-01-01T00:00:00.004Z"), 30.0)
        ),
    ]
    await wait_until(lambda: len(broker._waiting) == 4, 5, "both publishes awaiting acks")
    process.kill()
    results = await asyncio.wait_for(asyncio.gather(*pending), 10)
    assert time.monotonic() - started < 15  # well before the publishes' 30 s timeout
    for outcomes in results:
        assert len(outcomes) == 2
        assert all(isinstance(o, BrokerUnavailable) and "broke" in str(o) for o in outcomes), (
            outcomes
        )
    assert not broker._waiting


@pytest.mark.parametrize(
    ("data", "status", "expected"),
    [
        (b'{"stream":"HASCHEDULER","seq":5}', None, None),
        (b'{"stream":"HASCHEDULER","seq":5,"duplicate":true}', None, None),
        (b'{"stream":"error","seq":5}', None, None),  # "error" only as a stream name
        (
            b'{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"},'
            b'"stream":"HASCHEDULER","seq":0}',
            None,
            PublishRejected,
        ),
        (b"", b"503", BrokerUnavailable),  # no stream answered: electing, or missing
        (b"", b"408", PublishRejected),
        (b"", None, PublishRejected),
        (b'{"error": not json', None, PublishRejected),
    ],
)
def test_ack_error_reads_jetstream_replies(
    data: bytes, status: bytes | None, expected: type[Exception] | None
) -> None:
    error = ack_error(data, status)
    if expected is None:
        assert error is None
    else:
        assert type(error) is expected
        assert str(error)


async def test_acks_are_read_from_a_server_that_requires_a_password() -> None:
    server = start_nats(extra=("--user", "hs", "--pass", "s3cret"))
    try:
        uri = server.uri.replace("nats://", "nats://hs:s3cret@")
        b = NatsPublisher(NatsEndpoint.parse(uri))
        await b.start()
        try:
            assert await b.publish(messages(50), 5.0) == [None] * 50
        finally:
            await b.close()
    finally:
        server.stop()


class _Writer:
    def __init__(self) -> None:
        self.sent = b""

    def write(self, data: bytes) -> None:
        self.sent += data


def test_ack_frames_split_anywhere_are_delivered_whole_and_pings_answered() -> None:
    got: list[tuple[bytes, bytes, bytes | None]] = []
    reader = PublishConnection([], None, lambda *reply: got.append(reply))
    stream = (
        b"MSG _INBOX.x.1.0 1 27\r\n"
        b'{"stream":"S","seq":1}     \r\n'
        b"PING\r\n+OK\r\n"
        b"HMSG _INBOX.x.1.1 1 16 16\r\nNATS/1.0 503\r\n\r\n\r\n"
        b"MSG _INBOX.x.1.2 1 0\r\n\r\n"
    )
    writer = _Writer()
    for cut in range(1, len(stream)):  # every split into two reads
        got.clear()
        writer.sent = b""
        rest = reader._frames(stream[:cut], writer)
        assert reader._frames(rest + stream[cut:], writer) == b""
        assert got == [
            (b"_INBOX.x.1.0", b'{"stream":"S","seq":1}     ', None),
            (b"_INBOX.x.1.1", b"", b"503"),
            (b"_INBOX.x.1.2", b"", None),
        ], cut
        assert writer.sent == b"PONG\r\n"


def test_frames_are_what_nats_py_sends() -> None:
    from nats.protocol.command import hpub_cmd

    hdr = b"NATS/1.0\r\nNats-Msg-Id: s@t\r\nHascheduler-Term: 3\r\n\r\n"
    assert frame(
        "a.b", "_INBOX.x.1.0", "Nats-Msg-Id: s@t\r\nHascheduler-Term: 3\r\n", b'{"k":1}'
    ) == hpub_cmd("a.b", "_INBOX.x.1.0", hdr, b'{"k":1}')


def test_a_server_error_or_garbage_breaks_the_ack_connection() -> None:
    reader = PublishConnection([], None, lambda *reply: None)
    for line in (b"-ERR 'Stale Connection'\r\n", b"WHAT\r\n"):
        with pytest.raises(WireError):
            reader._frames(line, _Writer())


def test_a_clusters_advertised_members_are_tried_after_the_one_that_broke() -> None:
    connection = PublishConnection(
        ["nats://hs:s3cret@a:4222", "nats://hs:s3cret@b:4222"], None, lambda *reply: None
    )
    connection.server = "nats://hs:s3cret@a:4222"
    connection._frames(
        b'INFO {"connect_urls": ["a:4222", "c:4222", "bad host:1", "x@evil:1", 7]}\r\n', _Writer()
    )
    # The credentials of the configured servers, the members each once, the broken last.
    assert connection.candidates() == [
        "nats://hs:s3cret@b:4222",
        "nats://hs:s3cret@c:4222",
        "nats://hs:s3cret@a:4222",
    ]
