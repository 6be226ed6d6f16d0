"""log: one log line per fire, for demos and tests; nothing consumes or reads it back."""

from __future__ import annotations

from hascheduler.brokers.base import Broker, BrokerKind
from hascheduler.brokers.log.publisher import LogPublisher


def _parse(url: str) -> str:
    return url


def _publisher(_: str) -> Broker:
    return LogPublisher()


KIND = BrokerKind(
    name="log", schemes=frozenset({"log"}), example="log:", parse=_parse, publisher=_publisher
)
