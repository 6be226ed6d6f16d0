"""The contracts every broker keeps, declared once: what the leader publishes through
(Broker, and StagingBroker for a broker that frames fires ahead), what a worker consumes
from (FireConsumer, Delivered), what an audit reads back (FireReader), and the kind that
ties one broker's three parts to its URL (BrokerKind).

tests/test_broker_contract.py runs these rules over every kind in the registry.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from hascheduler.core.events import FireMessage, PreparedEvent

__all__ = [
    "SUBJECT_PREFIX",
    "Broker",
    "BrokerKind",
    "BrokerUnavailable",
    "Delivered",
    "FireConsumer",
    "FireMessage",
    "FireReader",
    "StagingBroker",
    "StoredFire",
]

SUBJECT_PREFIX = "hascheduler.fire"


class BrokerUnavailable(Exception):
    """The broker could not take a message now (down, unreachable, no acknowledgement in
    time, electing a leader); the fire stays claimed and is retried, at short intervals and
    without a limit. Any other exception is the broker refusing that message, retried up
    to the dispatcher's attempt limit."""


class Broker(Protocol):
    """Publishes fires (the leader's side).

    Rules every implementation keeps:
    - ``publish`` answers one outcome per message, in order: None once the broker has
      acknowledged (durably stored) it, or the exception that stopped it. It never raises
      for a single message's failure, and returns within ``timeout_s``.
    - The message's ``fire_id`` is the broker's deduplication key, so publishing the same
      fire twice (a republish after a failover) stores it once.
    - ``start`` does not fail because the broker is down: publishing fails until it is up.
    - A message whose target the broker cannot use fails alone.
    """

    async def start(self) -> None: ...

    async def publish(
        self, messages: Sequence[FireMessage], timeout_s: float
    ) -> list[BaseException | None]: ...

    async def close(self) -> None: ...


@runtime_checkable
class StagingBroker(Protocol):
    """A broker that frames a fire ahead of its due time (NATS): ``stage`` when the fire
    is rendered ahead, ``publish_staged`` at its publish, which joins in the instant it is
    fired at (``fired_field``). ``stage`` answers None for a fire it cannot frame; that
    fire goes through ``publish``, which refuses it as it says."""

    def stage(self, event: PreparedEvent) -> Any: ...

    async def publish_staged(
        self, staged: Sequence[Any], fired: bytes, timeout_s: float
    ) -> list[BaseException | None]: ...


class Delivered(Protocol):
    """One delivered message, whatever the broker (a nats-py message is one as it is)."""

    subject: str  # hascheduler.fire.<target>
    data: bytes

    async def ack(self) -> None: ...

    async def nak(self, delay: float | None = None) -> None: ...  # again after ``delay``

    async def term(self) -> None: ...  # never again (dead)

    async def in_progress(self) -> None: ...  # not to be redelivered yet


_Item = TypeVar("_Item")


class Arrivals(Generic[_Item]):
    """What a broker's callback handed over, waiting for a consumer's fetch (a fetch takes
    what is there, or waits for the first to come)."""

    def __init__(self) -> None:
        self._items: collections.deque[_Item] = collections.deque()
        self._came = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: _Item) -> None:
        self._items.append(item)
        self._came.set()

    def clear(self) -> None:
        self._items.clear()

    async def wait(self, wait_s: float) -> bool:
        """Whether anything is there, waiting up to ``wait_s`` for it."""
        if not self._items:
            self._came.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._came.wait(), wait_s)
        return bool(self._items)

    def take(self, up_to: int) -> list[_Item]:
        return [self._items.popleft() for _ in range(min(up_to, len(self._items)))]


class FireConsumer(Protocol):
    """Where a worker's fires come from (the worker's side).

    Rules: a fire is delivered again until it is acknowledged or terminated, after
    ``ack_wait_s`` without a sign of life (``in_progress`` or a heartbeat); every worker
    subscribed with the same durable name shares one stream of fires; an error in the
    kind's ``errors`` ends one subscription, never the worker, which subscribes again.
    """

    # True when the broker pushes deliveries up to ``in_flight`` unacknowledged (a
    # prefetch): a fetch then never has more to give than that. False when a fetch asks
    # for as many as it wants (a pull).
    pushes: bool

    async def connect(self, name: str) -> None: ...

    async def subscribe(
        self, durable: str, patterns: list[str], ack_wait_s: float, in_flight: int
    ) -> None: ...

    async def fetch(self, up_to: int, wait_s: float) -> Sequence[Delivered]: ...  # [] idle

    async def close(self) -> None: ...


@dataclass(frozen=True)
class StoredFire:
    """One fire as the broker kept it, for an audit."""

    event: dict[str, Any]  # the CloudEvent
    stored_at: dt.datetime | None  # when the broker stored it, by its clock, if it says


FireReader = Callable[[], Awaitable[list[StoredFire]]]

E = TypeVar("E")


@dataclass(frozen=True)
class BrokerKind(Generic[E]):
    """One kind of broker: the URL schemes that name it and how each part is built from
    the endpoint its URL parses into. A part a kind does not have is None."""

    name: str
    schemes: frozenset[str]
    example: str  # a URL of this kind, for messages
    parse: Callable[[str], E]  # raises ValueError naming what is wrong
    publisher: Callable[[E], Broker]
    # (endpoint, ack wait in seconds): a worker's consumer
    consumer: Callable[[E, float], FireConsumer] | None = None
    # every fire the broker holds, left in place
    reader: Callable[[E], FireReader] | None = None
    # what the broker's client raises when the broker is away: a consumer's
    # subscription ends and is made again (a function: the client is imported only by the
    # processes that use this kind)
    errors: Callable[[], tuple[type[BaseException], ...]] = tuple
