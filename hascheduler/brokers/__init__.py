"""Where fires go: a broker chosen by URL (``nats://...``, ``amqp://...`` or ``log:``)."""

from __future__ import annotations

from urllib.parse import urlparse

from .amqp import AmqpBroker, AmqpEndpoint
from .base import Broker, BrokerUnavailable, FireMessage
from .log import LogBroker
from .nats import NatsBroker, NatsEndpoint


def broker_from_url(url: str) -> Broker:
    """The broker a URL names. Raises ValueError naming what is wrong with the URL."""
    parsed = urlparse(url)
    if parsed.scheme == "log":
        return LogBroker()
    if parsed.scheme in {"nats", "tls"}:
        return NatsBroker(NatsEndpoint.parse(url))
    if parsed.scheme in {"amqp", "amqps"}:
        return AmqpBroker(AmqpEndpoint.parse(url))
    raise ValueError(f"unsupported broker URL {url!r}: use nats://host:port, "
                     "amqp://user:password@host:port/vhost or log:")


__all__ = ["AmqpBroker", "AmqpEndpoint", "Broker", "BrokerUnavailable", "FireMessage",
           "LogBroker", "NatsBroker", "NatsEndpoint", "broker_from_url"]
