"""The one place a broker's kind is decided: by its URL's scheme."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from hascheduler.brokers import amqp, log, nats
from hascheduler.brokers.base import Broker, BrokerKind, FireConsumer, FireReader

KINDS: tuple[BrokerKind[Any], ...] = (log.KIND, nats.KIND, amqp.KIND)


@dataclass(frozen=True)
class BrokerUrl:
    """A broker URL parsed once (when settings are read): its kind and endpoint. Clients
    are built from it inside a component's lifecycle."""

    text: str
    kind: BrokerKind[Any]
    endpoint: Any  # what kind.parse made of the text

    def __str__(self) -> str:
        return self.text

    def publisher(self) -> Broker:
        return self.kind.publisher(self.endpoint)

    def consumer(self, ack_wait_s: float) -> FireConsumer:
        """A worker's consumer. Raises ValueError if this kind has none."""
        if self.kind.consumer is None:
            raise ValueError(f"{self.kind.name} has nothing for a worker to consume")
        return self.kind.consumer(self.endpoint, ack_wait_s)

    def reader(self) -> FireReader:
        """Every fire the broker keeps, for an audit. Raises ValueError if this kind keeps
        none."""
        if self.kind.reader is None:
            raise ValueError(f"{self.kind.name} keeps no fires to read back")
        return self.kind.reader(self.endpoint)


def parse_broker_url(text: str) -> BrokerUrl:
    """The broker a URL names. Raises ValueError naming what is wrong with the URL."""
    scheme = urlparse(text).scheme
    for kind in KINDS:
        if scheme in kind.schemes:
            return BrokerUrl(text, kind, kind.parse(text))
    raise ValueError(
        f"unsupported broker URL {text!r}: use "
        + ", ".join(kind.example for kind in KINDS[1:])
        + f" or {KINDS[0].example}"
    )


def consumable_url(text: str | None) -> BrokerUrl:
    """A broker URL a worker can consume from. Raises ValueError saying which kinds do."""
    consumable = [kind for kind in KINDS if kind.consumer is not None]
    kinds = " or ".join(f"{kind.example.split(':')[0]}://" for kind in consumable)
    if not text:
        raise ValueError(f"a {kinds} URL is required")
    url = parse_broker_url(text)
    if url.kind.consumer is None:
        raise ValueError(
            f"must be a {kinds} URL: {url.kind.name} has nothing for a worker to consume"
        )
    return url
