"""Samples of the database server's clock for ServerClock (core/clock.py): ``hello``
answers with the server's ``localTime``, a command every driver and server has, as cheap
as a ping."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from pymongo.errors import PyMongoError

from hascheduler.core.clock import ServerClock
from hascheduler.core.instants import as_utc


class Commands(Protocol):
    """A database handle as far as running a command goes."""

    async def command(self, command: Any, *args: Any, **kwargs: Any) -> Any: ...


async def sample(db: Commands, clock: ServerClock) -> None:
    """One round trip to the server, its time given to ``clock``. Raises PyMongoError."""
    sent = clock.monotonic()
    reply = await db.command("hello")
    received = clock.monotonic()
    local_time = as_utc(reply.get("localTime"))
    if isinstance(local_time, dt.datetime):
        clock.observe(sent, received, local_time)


def sampler(db: Commands, clock: ServerClock) -> Callable[[], Awaitable[None]]:
    """``sample`` for an Every service: a database away only means no sample this time."""

    async def take() -> None:
        with contextlib.suppress(PyMongoError):
            await sample(db, clock)

    return take
