"""MongoDB wire protocol framing: OP_MSG, and the legacy OP_QUERY/OP_REPLY handshake.

Pure functions over bytes; the server (server.py) does the I/O. Layouts follow MongoDB's
wire protocol reference and the OP_MSG driver specification.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import bson
from bson.codec_options import CodecOptions

from hascheduler_dev.devmongo.values import Document

OP_REPLY = 1
OP_QUERY = 2004
OP_COMPRESSED = 2012
OP_MSG = 2013

FLAG_CHECKSUM_PRESENT = 1 << 0
FLAG_MORE_TO_COME = 1 << 1
FLAG_EXHAUST_ALLOWED = 1 << 16

HEADER = struct.Struct("<iiii")
MAX_MESSAGE_SIZE = 48_000_000

# Dates stay naive UTC, as mongomock's matching expects; documents keep field order.
CODEC = CodecOptions(document_class=dict, tz_aware=False)


class ProtocolError(Exception):
    """The bytes do not form a message we can answer; the connection must be closed."""


@dataclass(slots=True)
class Header:
    length: int
    request_id: int
    response_to: int
    op_code: int


@dataclass(slots=True)
class Message:
    """A parsed request: the command document and where it came from."""

    header: Header
    body: Document
    flags: int = 0
    sequences: dict[str, list[Document]] = field(default_factory=dict)
    legacy_namespace: str | None = None  # set for OP_QUERY

    @property
    def more_to_come(self) -> bool:
        return bool(self.flags & FLAG_MORE_TO_COME)

    @property
    def exhaust_allowed(self) -> bool:
        return bool(self.flags & FLAG_EXHAUST_ALLOWED)


def parse_header(data: bytes) -> Header:
    length, request_id, response_to, op_code = HEADER.unpack(data)
    if length < HEADER.size or length > MAX_MESSAGE_SIZE:
        raise ProtocolError(f"invalid message length {length}")
    return Header(length, request_id, response_to, op_code)


def _read_document(payload: bytes, offset: int, end: int | None = None) -> tuple[Document, int]:
    end = len(payload) if end is None else end
    if offset + 4 > end:
        raise ProtocolError("truncated BSON document")
    (size,) = struct.unpack_from("<i", payload, offset)
    if size < 5 or offset + size > end:
        raise ProtocolError("invalid BSON document size")
    try:
        doc = bson.decode(payload[offset : offset + size], CODEC)
    except Exception as exc:  # bson raises several unrelated types for bad input
        raise ProtocolError(f"invalid BSON: {exc}") from exc
    return doc, offset + size


def _read_documents(payload: bytes, offset: int, end: int) -> list[Document]:
    """The documents laid end to end in ``payload[offset:end]`` (a document sequence):
    decoded in one call, which checks each one's size against the rest (a call per
    document, and its codec options read anew each time, was a tenth of an insert's
    time)."""
    try:
        docs: list[Document] = bson.decode_all(payload[offset:end], CODEC)
    except Exception as exc:  # bson raises several unrelated types for bad input
        raise ProtocolError(f"invalid BSON: {exc}") from exc
    return docs


def _read_cstring(payload: bytes, offset: int) -> tuple[str, int]:
    end = payload.find(b"\0", offset)
    if end < 0:
        raise ProtocolError("unterminated C string")
    return payload[offset:end].decode("utf-8", "replace"), end + 1


def parse_op_msg(header: Header, payload: bytes) -> Message:
    """Parse an OP_MSG body (everything after the 16-byte header)."""
    if len(payload) < 5:
        raise ProtocolError("OP_MSG too short")
    (flags,) = struct.unpack_from("<I", payload, 0)
    end = len(payload) - 4 if flags & FLAG_CHECKSUM_PRESENT else len(payload)
    # Required flag bits (0-15) we do not know make the message unanswerable, per spec.
    if flags & 0xFFFC:
        raise ProtocolError(f"unknown required OP_MSG flag bits {flags:#x}")
    offset = 4
    body: Document | None = None
    sequences: dict[str, list[Document]] = {}
    while offset < end:
        kind = payload[offset]
        offset += 1
        if kind == 0:
            if body is not None:
                raise ProtocolError("OP_MSG with two body sections")
            body, offset = _read_document(payload, offset, end)
        elif kind == 1:
            (size,) = struct.unpack_from("<i", payload, offset)
            section_end = offset + size
            if size < 5 or section_end > end:
                raise ProtocolError("invalid document sequence size")
            identifier, cursor = _read_cstring(payload, offset + 4)
            sequences[identifier] = _read_documents(payload, cursor, section_end)
            offset = section_end
        else:
            raise ProtocolError(f"unknown OP_MSG section kind {kind}")
    if body is None:
        raise ProtocolError("OP_MSG without a body section")
    for identifier, docs in sequences.items():
        if identifier in body:
            raise ProtocolError(f"OP_MSG field {identifier!r} in both body and sequence")
        body[identifier] = docs
    return Message(header, body, flags, sequences)


def parse_op_query(header: Header, payload: bytes) -> Message:
    """Parse a legacy OP_QUERY (only commands on ``<db>.$cmd`` are answered)."""
    offset = 4  # flags
    namespace, offset = _read_cstring(payload, offset)
    offset += 8  # numberToSkip, numberToReturn
    query, offset = _read_document(payload, offset)
    if "$query" in query and isinstance(query["$query"], dict):
        query = query["$query"]
    return Message(header, query, 0, {}, legacy_namespace=namespace)


def encode_op_msg(request_id: int, response_to: int, body: Document, flags: int = 0) -> bytes:
    payload = struct.pack("<IB", flags, 0) + bson.encode(body, codec_options=CODEC)
    return HEADER.pack(HEADER.size + len(payload), request_id, response_to, OP_MSG) + payload


def encode_op_reply(request_id: int, response_to: int, doc: Document) -> bytes:
    payload = struct.pack("<iqii", 0, 0, 0, 1) + bson.encode(doc, codec_options=CODEC)
    return HEADER.pack(HEADER.size + len(payload), request_id, response_to, OP_REPLY) + payload


def encode_op_msg_request(
    request_id: int,
    body: Document,
    flags: int = 0,
    sequences: dict[str, list[Document]] | None = None,
) -> bytes:
    """A client-side OP_MSG, for tests of the framing."""
    payload = struct.pack("<IB", flags, 0) + bson.encode(body)
    for identifier, docs in (sequences or {}).items():
        section = identifier.encode() + b"\0" + b"".join(bson.encode(d) for d in docs)
        payload += struct.pack("<Bi", 1, len(section) + 4) + section
    if flags & FLAG_CHECKSUM_PRESENT:
        payload += b"\0\0\0\0"
    return HEADER.pack(HEADER.size + len(payload), request_id, 0, OP_MSG) + payload


def decode_reply(data: bytes) -> tuple[Header, int, Any]:
    """Split a server reply into (header, flags, document), for tests and tooling."""
    header = parse_header(data[:16])
    payload = data[16 : header.length]
    if header.op_code == OP_MSG:
        msg = parse_op_msg(header, payload)
        return header, msg.flags, msg.body
    if header.op_code == OP_REPLY:
        doc, _ = _read_document(payload, 20)
        return header, 0, doc
    raise ProtocolError(f"unexpected reply op code {header.op_code}")
