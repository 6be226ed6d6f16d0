"""The wire protocol over a raw socket: framing, legacy handshake, errors, streaming hello."""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Any
from urllib.parse import urlparse

import bson
import pytest
from hascheduler_dev.devmongo import wire
from pymongo import AsyncMongoClient

from bench.devmongo_bench import cpu_seconds
from tests.servers import ServerProcess

pytestmark = pytest.mark.devmongo_only  # speaks to the server's own framing limits


class RawConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.next_id = 1

    @classmethod
    async def open(cls, uri: str) -> RawConnection:
        parsed = urlparse(uri)
        reader, writer = await asyncio.open_connection(parsed.hostname, parsed.port)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def command(
        self,
        body: dict[str, Any],
        flags: int = 0,
        sequences: dict[str, list[dict[str, Any]]] | None = None,
    ) -> int:
        request_id = self.next_id
        self.next_id += 1
        await self.send(wire.encode_op_msg_request(request_id, body, flags, sequences))
        return request_id

    async def reply(self, within_s: float = 5.0) -> tuple[wire.Header, int, Any]:
        head = await asyncio.wait_for(self.reader.readexactly(16), within_s)
        header = wire.parse_header(head)
        rest = await asyncio.wait_for(self.reader.readexactly(header.length - 16), within_s)
        return wire.decode_reply(head + rest)

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


@pytest.fixture
async def raw(mongo_server: ServerProcess) -> Any:
    conn = await RawConnection.open(mongo_server.uri)
    yield conn
    await conn.close()


def legacy_query(request_id: int, namespace: str, query: dict[str, Any]) -> bytes:
    payload = (
        struct.pack("<i", 0)
        + namespace.encode()
        + b"\0"
        + struct.pack("<ii", 0, -1)
        + bson.encode(query)
    )
    return struct.pack("<iiii", 16 + len(payload), request_id, 0, wire.OP_QUERY) + payload


async def test_legacy_op_query_handshake_is_answered_with_op_reply(raw: RawConnection) -> None:
    await raw.send(legacy_query(7, "admin.$cmd", {"isMaster": 1, "helloOk": True}))
    header, _, doc = await raw.reply()
    assert header.op_code == wire.OP_REPLY
    assert header.response_to == 7
    assert doc["ismaster"] is True
    assert doc["helloOk"] is True
    assert doc["setName"] == "rs0"
    assert doc["maxWireVersion"] == 21
    assert doc["hosts"] == [doc["me"]]
    assert doc["primary"] == doc["me"]
    for field in ("setVersion", "electionId", "topologyVersion", "logicalSessionTimeoutMinutes"):
        assert field in doc


async def test_hello_and_cluster_time_on_every_reply(raw: RawConnection) -> None:
    rid = await raw.command({"hello": 1, "$db": "admin"})
    header, _, doc = await raw.reply()
    assert header.op_code == wire.OP_MSG
    assert header.response_to == rid
    assert doc["isWritablePrimary"] is True
    await raw.command({"nope": 1, "$db": "admin"})
    _, _, err = await raw.reply()
    assert (err["ok"], err["code"], err["codeName"]) == (0.0, 59, "CommandNotFound")
    for reply in (doc, err):
        assert "clusterTime" in reply["$clusterTime"]
        assert "operationTime" in reply


async def test_document_sequences_and_checksum_flag(raw: RawConnection) -> None:
    docs = [{"_id": i} for i in range(3)]
    await raw.command(
        {"insert": "seq", "$db": "wiretest"},
        sequences={"documents": docs},
        flags=wire.FLAG_CHECKSUM_PRESENT,
    )
    _, _, reply = await raw.reply()
    assert reply["ok"] == 1.0
    assert reply["n"] == 3
    await raw.command({"find": "seq", "$db": "wiretest"})
    _, _, found = await raw.reply()
    assert found["cursor"]["firstBatch"] == docs


async def test_more_to_come_request_gets_no_reply(raw: RawConnection) -> None:
    await raw.command(
        {"insert": "w0", "documents": [{"_id": 1}], "$db": "wiretest", "writeConcern": {"w": 0}},
        flags=wire.FLAG_MORE_TO_COME,
    )
    rid = await raw.command({"count": "w0", "$db": "wiretest"})
    header, _, reply = await raw.reply()
    assert header.response_to == rid, "the unacknowledged write must not be answered"
    assert reply["n"] == 1


async def test_unsupported_op_code_is_an_error_not_a_dropped_connection(raw: RawConnection) -> None:
    legacy_insert = struct.pack("<iiii", 16 + 4, 9, 0, 2002) + b"\0\0\0\0"
    await raw.send(legacy_insert)
    _, _, reply = await raw.reply()
    assert reply["code"] == 59
    await raw.send(legacy_query(10, "wiretest.coll", {"find": 1}))
    _, _, legacy = await raw.reply()
    assert legacy["code"] == 352
    await raw.command({"ping": 1, "$db": "admin"})
    _, _, pong = await raw.reply()
    assert pong["ok"] == 1.0


async def test_awaitable_hello_waits_and_streams_with_more_to_come(raw: RawConnection) -> None:
    await raw.command({"hello": 1, "$db": "admin"})
    _, _, first = await raw.reply()
    start = time.monotonic()
    rid = await raw.command(
        {
            "hello": 1,
            "$db": "admin",
            "maxAwaitTimeMS": 300,
            "topologyVersion": first["topologyVersion"],
        },
        flags=wire.FLAG_EXHAUST_ALLOWED,
    )
    header1, flags1, _ = await raw.reply()
    waited = time.monotonic() - start
    header2, flags2, _ = await raw.reply()
    assert 0.25 <= waited < 2.0, "an awaitable hello holds its reply for maxAwaitTimeMS"
    assert header1.response_to == rid
    assert flags1 & wire.FLAG_MORE_TO_COME
    assert header2.response_to == header1.request_id
    assert flags2 & wire.FLAG_MORE_TO_COME


async def test_idle_clients_do_not_make_the_server_spin(mongo_server: ServerProcess) -> None:
    assert mongo_server.pid is not None
    clients: list[AsyncMongoClient[dict[str, Any]]] = [
        AsyncMongoClient(mongo_server.uri) for _ in range(5)
    ]
    try:
        for c in clients:
            await c.admin.command("ping")
        before = cpu_seconds(mongo_server.pid)
        start = time.monotonic()
        await asyncio.sleep(3.0)  # the measurement window itself: idle is what we measure
        used = cpu_seconds(mongo_server.pid) - before
        elapsed = time.monotonic() - start
    finally:
        for c in clients:
            await c.close()
    # Five monitored clients idle for 3 s: well under 5 % of one core.
    assert used / elapsed < 0.05, f"server used {used:.3f}s CPU in {elapsed:.1f}s idle"


def test_op_msg_parser_rejects_unknown_required_flags() -> None:
    data = wire.encode_op_msg_request(1, {"ping": 1, "$db": "admin"}, flags=1 << 5)
    header = wire.parse_header(data[:16])
    with pytest.raises(wire.ProtocolError):
        wire.parse_op_msg(header, data[16:])


@pytest.mark.parametrize("damage", ["truncated", "overlong", "trailing"])
def test_op_msg_parser_rejects_a_damaged_document_sequence(damage: str) -> None:
    """A sequence's documents are decoded together: any one whose size does not fit the
    section, or bytes left after the last, make the message a protocol error, never a
    document cut short."""
    body = bson.encode({"insert": "seq", "$db": "wiretest"})
    docs = [bson.encode({"_id": i, "x": "y" * 10}) for i in range(3)]
    if damage == "truncated":
        docs[-1] = docs[-1][:-3]
    elif damage == "overlong":
        docs[1] = struct.pack("<i", len(docs[1]) + 40) + docs[1][4:]
    else:
        docs.append(b"\x07\x00")
    section = b"documents\0" + b"".join(docs)
    payload = struct.pack("<IB", 0, 0) + body + struct.pack("<Bi", 1, len(section) + 4) + section
    header = wire.Header(16 + len(payload), 1, 0, wire.OP_MSG)
    with pytest.raises(wire.ProtocolError):
        wire.parse_op_msg(header, payload)
    intact = b"documents\0" + b"".join(bson.encode({"_id": i}) for i in range(3))
    good = struct.pack("<IB", 0, 0) + body + struct.pack("<Bi", 1, len(intact) + 4) + intact
    assert wire.parse_op_msg(wire.Header(16 + len(good), 1, 0, wire.OP_MSG), good).body[
        "documents"
    ] == [{"_id": i} for i in range(3)]
