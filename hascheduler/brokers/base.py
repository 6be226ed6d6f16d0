"""The broker contract every implementation keeps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

SUBJECT_PREFIX = "hascheduler.fire"


@dataclass(frozen=True, slots=True)
class FireMessage:
    fire_id: str  # the broker's deduplication key (Nats-Msg-Id, AMQP message_id)
    target: str   # the schedule's target: subject suffix or routing key
    term: int
    body: bytes   # a CloudEvents 1.0 structured JSON document


class BrokerUnavailable(Exception):
    """The broker could not take a message now (down, unreachable, no acknowledgement in
    time, electing a leader); the fire stays claimed and is retried, at short intervals and
    without a limit. Any other exception is the broker refusing that message, retried up
    to the dispatcher's attempt limit."""


class Broker(Protocol):
    """Publishes fires.

    Rules every implementation keeps:
    - ``publish`` answers one outcome per message, in order: None once the broker has
      acknowledged (durably stored) it, or the exception that stopped it. It never raises
      for a single message's failure, and returns within ``timeout_s``.
    - The message's ``fire_id`` is the broker's deduplication key, so publishing the same
      fire twice (a republish after a failover) stores it once.
    - ``start`` does not fail because the broker is down: publishing fails until it is up.
    - A message whose target the broker cannot use fails alone.

    tests/test_broker_contract.py runs these rules over every implementation.
    """

    async def start(self) -> None: ...

    async def publish(self, messages: Sequence[FireMessage],
                      timeout_s: float) -> list[BaseException | None]: ...

    async def close(self) -> None: ...
