"""The development server's network side: one asyncio task per client connection."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import signal
import ssl
from collections.abc import AsyncIterator

import structlog

from hascheduler_dev.devmongo import native, wire
from hascheduler_dev.devmongo.node import CloseConnection, ConnectionContext, Node
from hascheduler_dev.devmongo.settings import Settings

log = structlog.get_logger("hascheduler.devmongo")


def tls_context(certificate_key_file: str) -> ssl.SSLContext:
    """Raises OSError or ssl.SSLError when the file is missing or not a certificate + key."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certificate_key_file)
    return context


class DevMongoServer:
    """Serves a Node over TCP; ``async with`` starts it, leaving closes every connection."""

    def __init__(self, settings: Settings) -> None:
        self.node = Node(settings)
        self._server: asyncio.Server | None = None
        self._request_ids = itertools.count(1)
        self._conn_ids = itertools.count(1)
        self._connections: set[asyncio.Task[None]] = set()
        self._background: list[asyncio.Task[None]] = []

    @property
    def uri(self) -> str:
        s = self.node.settings
        tls = "&tls=true" if s.tls_certificate_key_file else ""
        return f"mongodb://{s.host}:{s.port}/?replicaSet={s.replset}{tls}"

    async def start(self) -> None:
        s = self.node.settings
        context = tls_context(s.tls_certificate_key_file) if s.tls_certificate_key_file else None
        self._server = await asyncio.start_server(
            self._serve, s.host, s.port, limit=wire.MAX_MESSAGE_SIZE, ssl=context
        )
        if s.port == 0:
            s.port = self._server.sockets[0].getsockname()[1]
        self._background = [
            asyncio.create_task(self._every(s.ttl_interval_s, self.node.reap_expired_documents)),
            asyncio.create_task(self._every(1.0, self.node.reap_idle_cursors)),
        ]
        log.info(
            "devmongo_listening",
            uri=self.uri,
            replset=s.replset,
            oplog_size=s.oplog_size,
            compiled=native.running_compiled(),
        )

    async def stop(self) -> None:
        self.node.shutting_down.set()
        if self._server is not None:
            self._server.close()
        for task in [*self._background, *self._connections]:
            task.cancel()
        await asyncio.gather(*self._background, *self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        log.info("devmongo_stopped")

    async def __aenter__(self) -> DevMongoServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @staticmethod
    async def _every(interval: float, work: object) -> None:
        assert callable(work)
        while True:
            await asyncio.sleep(interval)
            try:
                done = work()
                if inspect.isawaitable(done):
                    await done
            except Exception:
                log.exception("background_work_failed")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        peer = writer.get_extra_info("peername")
        ctx = ConnectionContext(
            next(self._conn_ids),
            f"{peer[0]}:{peer[1]}" if peer else "?",
            generation=self.node.connection_generation,
        )
        self.node.connections_current += 1
        self.node.connections_total += 1
        try:
            async for reply in self._replies(reader, ctx):
                writer.write(reply)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, CloseConnection):
            pass
        except wire.ProtocolError as exc:
            log.warning("protocol_error", peer=ctx.peer, error=str(exc))
        finally:
            self.node.connections_current -= 1
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _replies(
        self, reader: asyncio.StreamReader, ctx: ConnectionContext
    ) -> AsyncIterator[bytes]:
        while True:
            header = wire.parse_header(await reader.readexactly(wire.HEADER.size))
            payload = await reader.readexactly(header.length - wire.HEADER.size)
            if header.op_code == wire.OP_MSG:
                msg = wire.parse_op_msg(header, payload)
            elif header.op_code == wire.OP_QUERY:
                msg = wire.parse_op_query(header, payload)
            else:
                yield wire.encode_op_msg(
                    next(self._request_ids),
                    header.request_id,
                    {
                        "ok": 0.0,
                        "code": 59,
                        "codeName": "CommandNotFound",
                        "errmsg": f"unsupported op code {header.op_code}: the development server "
                        "speaks OP_MSG (and OP_QUERY for the handshake)",
                    },
                )
                continue
            async for reply in self._answer(msg, ctx):
                yield reply

    async def _answer(self, msg: wire.Message, ctx: ConnectionContext) -> AsyncIterator[bytes]:
        request_id = msg.header.request_id
        if msg.legacy_namespace is not None:
            db, _, coll = msg.legacy_namespace.partition(".")
            if coll != "$cmd":
                yield wire.encode_op_reply(
                    next(self._request_ids),
                    request_id,
                    {
                        "$err": "OP_QUERY is no longer supported except for commands on $cmd",
                        "code": 352,
                        "codeName": "UnsupportedOpQueryCommand",
                        "ok": 0.0,
                    },
                )
                return
            reply = await self.node.execute(db, msg.body, ctx)
            yield wire.encode_op_reply(next(self._request_ids), request_id, reply)
            return
        db_name = msg.body.get("$db")
        if not isinstance(db_name, str):
            reply = {
                "ok": 0.0,
                "code": 40571,
                "codeName": "Location40571",
                "errmsg": "OP_MSG requests require a $db argument",
            }
            yield wire.encode_op_msg(next(self._request_ids), request_id, reply)
            return
        db = db_name
        reply = await self.node.execute(db, msg.body, ctx)
        if msg.more_to_come:
            return  # an unacknowledged write: the client reads no reply
        name = next(iter(msg.body), "")
        streaming = (
            msg.exhaust_allowed
            and name in {"hello", "isMaster", "ismaster"}
            and "maxAwaitTimeMS" in msg.body
            and reply.get("ok") == 1.0
        )
        reply_id = next(self._request_ids)
        flags = wire.FLAG_MORE_TO_COME if streaming else 0
        yield wire.encode_op_msg(reply_id, request_id, reply, flags)
        # Streaming monitor protocol: keep answering the same awaitable hello, each reply
        # responding to the previous one, until the client hangs up.
        while streaming:
            reply = await self.node.execute(db, msg.body, ctx)
            streaming = reply.get("ok") == 1.0
            previous, reply_id = reply_id, next(self._request_ids)
            flags = wire.FLAG_MORE_TO_COME if streaming else 0
            yield wire.encode_op_msg(reply_id, previous, reply, flags)


async def serve_forever(settings: Settings, announce: bool = True) -> None:
    """Run until SIGTERM or SIGINT, printing the connection URI on one line first."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with DevMongoServer(settings) as server:
        if announce:
            print(server.uri, flush=True)
        await stop.wait()
