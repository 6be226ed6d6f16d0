"""The NATS source's pull requests, against a stand-in connection: one request open at a
time, asking for what the worker can take; a status ends it, a heartbeat does not; one
whose end never came is taken as ended after its expiry. (tests/test_broker_parts.py
runs the same source against a real nats-server.)"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from hascheduler.brokers.nats.consumer import NatsConsumer
from hascheduler.brokers.nats.publisher import NatsEndpoint


class Connection:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    async def publish(self, subject: str, payload: bytes, reply: str) -> None:
        assert subject == "$JS.API.CONSUMER.MSG.NEXT.HASCHEDULER.d"
        assert reply == "_INBOX.x"
        self.requests.append(json.loads(payload))


def message(i: int, reply: str | None = "$JS.ACK.HASCHEDULER.d.1.1.1.0.0") -> Any:
    return SimpleNamespace(
        headers={"Nats-Msg-Id": f"m{i}"},
        data=str(i).encode(),
        subject="hascheduler.fire.a",
        reply=reply,
    )


def status(code: str) -> Any:
    return SimpleNamespace(
        headers={"Status": code, "Description": "why"}, data=b"", subject="_INBOX.x", reply=""
    )


def a_source() -> tuple[NatsConsumer, Connection]:
    source = NatsConsumer(NatsEndpoint.parse("nats://127.0.0.1:4222"))
    nc = source._nc = Connection()
    source._next, source._inbox = "$JS.API.CONSUMER.MSG.NEXT.HASCHEDULER.d", "_INBOX.x"
    return source, nc


async def test_one_pull_request_at_a_time_ended_by_a_status_or_its_expiry() -> None:
    source, nc = a_source()

    assert await source.fetch(3, 0.01) == []  # an empty stream: the wait waited out
    assert nc.requests == [{"batch": 3, "expires": 10_000_000}]
    assert await source.fetch(3, 0.01) == []
    assert len(nc.requests) == 1  # still open: no second request
    await source._on_message(status("100"))  # a heartbeat: it goes on
    assert await source.fetch(3, 0.01) == []
    assert len(nc.requests) == 1
    await source._on_message(status("408"))  # expired
    assert await source.fetch(4, 0.01) == []
    assert nc.requests[-1] == {"batch": 4, "expires": 10_000_000}

    for i in range(3):
        await source._on_message(message(i))
    assert [m.data for m in await source.fetch(2, 0.01)] == [b"0", b"1"]
    assert [m.data for m in await source.fetch(5, 0.01)] == [b"2"]  # what was left
    assert len(nc.requests) == 2  # one more may still come for that request
    await source._on_message(message(3))  # its last: the request is done
    assert [m.data for m in await source.fetch(5, 0.01)] == [b"3"]
    assert await source.fetch(5, 0.01) == []
    assert nc.requests[-1] == {"batch": 5, "expires": 10_000_000}

    source._open_until = 0.0  # its expiry long past, and no status came (a reconnect)
    assert await source.fetch(6, 0.01) == []
    assert nc.requests[-1] == {"batch": 6, "expires": 10_000_000}
    await source._on_message(status("409"))  # the consumer's trouble ends it too
    assert await source.fetch(7, 0.01) == []
    assert nc.requests[-1] == {"batch": 7, "expires": 10_000_000}


async def test_what_nobody_asked_for_or_cannot_be_acknowledged_is_dropped() -> None:
    """Anyone may publish to an inbox: a flood of messages with no request open, or more
    than the request asked for, or messages JetStream did not send (no reply subject to
    acknowledge to), never pile up or reach the worker."""
    source, nc = a_source()
    for i in range(10_000):  # no request open yet
        await source._on_message(message(i))
    assert len(source._ready) == 0
    assert await source.fetch(3, 0.01) == []  # asks for 3
    await source._on_message(message(1, reply=""))  # not JetStream's
    await source._on_message(message(2, reply=None))
    for i in range(10_000):  # far more than asked
        await source._on_message(message(i))
    assert len(source._ready) == 3
    assert [m.data for m in await source.fetch(10, 0.01)] == [b"0", b"1", b"2"]
    assert await source.fetch(10, 0.01) == []
    assert nc.requests[-1] == {"batch": 10, "expires": 10_000_000}
