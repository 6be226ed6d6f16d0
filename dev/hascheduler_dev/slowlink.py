"""A slow link the test controls: a TCP proxy on loopback that delays what it forwards.

The kernel here has no ``tc netem`` to add latency to a link; a process that connects
through ``SlowLink`` instead of straight to its server gets ``delay_s`` added each way
(changed at any moment; bytes keep their order), and ``sever`` closes every connection
it carries, as a link that drops everything for a moment would end them. Loss itself is
nftables' job (netns.Network.lossy).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class SlowLink:
    """``async with SlowLink(host, port) as link``: connect to ``link.port`` on loopback."""

    def __init__(self, host: str, port: int, delay_s: float = 0.0) -> None:
        self.target = (host, port)
        self.delay_s = delay_s
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> SlowLink:
        self._server = await asyncio.start_server(self._carry, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
        self.sever()
        for task in list(self._pipes):
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await task

    def sever(self) -> None:
        """Close every connection carried now (new ones are still accepted)."""
        for writer in list(self._writers):
            writer.close()
        for task in list(self._pipes):
            task.cancel()

    async def _carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        pipes = [
            asyncio.create_task(self._pipe(reader, up_writer)),
            asyncio.create_task(self._pipe(up_reader, writer)),
        ]
        self._pipes.update(pipes)
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pipes:
                task.cancel()
                self._pipes.discard(task)
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.close()

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        """Forward each chunk ``delay_s`` after it arrived, in order."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                if not chunk:
                    return
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                sink.write(chunk)
                await sink.drain()

        delivering = asyncio.create_task(deliver())
        try:
            async for chunk in _chunks(source):
                queue.put_nowait((loop.time() + self.delay_s, chunk))
            queue.put_nowait((loop.time(), b""))
            await delivering
        finally:
            delivering.cancel()


async def _chunks(source: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while chunk := await source.read(65536):
        yield chunk
