"""NATS JetStream: fires stored in a stream, deduplicated by fire id within its window."""

from __future__ import annotations

import nats.errors

from hascheduler.brokers.base import BrokerKind, FireConsumer, FireReader
from hascheduler.brokers.nats.consumer import NatsConsumer
from hascheduler.brokers.nats.publisher import NatsEndpoint, NatsPublisher
from hascheduler.brokers.nats.reader import read_stream


def _consumer(endpoint: NatsEndpoint, ack_wait_s: float) -> FireConsumer:
    return NatsConsumer(endpoint)


def _reader(endpoint: NatsEndpoint) -> FireReader:
    return lambda: read_stream(endpoint)


def _errors() -> tuple[type[BaseException], ...]:
    # TimeoutError is also what nats-py raises when a request gets no answer in time.
    return (nats.errors.Error, OSError, TimeoutError)


KIND = BrokerKind(
    name="NATS JetStream",
    schemes=frozenset({"nats", "tls"}),
    example="nats://host:port",
    parse=NatsEndpoint.parse,
    publisher=NatsPublisher,
    consumer=_consumer,
    reader=_reader,
    errors=_errors,
)
