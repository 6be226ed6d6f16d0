"""RabbitMQ (AMQP 0-9-1): fires on a topic exchange, Celery task messages for celery:
targets, quorum queues for workers.

Only the URL's parsing is imported here: the publisher, the consumer, the reader and
the client's errors load aio-pika, and are imported when a RabbitMQ broker is used (every
process reads the broker registry; a NATS one would pay for an AMQP client it never
uses)."""

from __future__ import annotations

from hascheduler.brokers.amqp.endpoint import AmqpEndpoint
from hascheduler.brokers.base import Broker, BrokerKind, FireConsumer, FireReader


def _publisher(endpoint: AmqpEndpoint) -> Broker:
    from hascheduler.brokers.amqp.publisher import AmqpPublisher

    return AmqpPublisher(endpoint)


def _consumer(endpoint: AmqpEndpoint, ack_wait_s: float) -> FireConsumer:
    from hascheduler.brokers.amqp.consumer import AmqpConsumer

    # Missed heartbeats close the connection and requeue what it held: a stalled worker's
    # fires go to another within about the ack wait.
    return AmqpConsumer(endpoint, heartbeat_s=max(1, round(ack_wait_s / 3)))


def _reader(endpoint: AmqpEndpoint) -> FireReader:
    from hascheduler.brokers.amqp.reader import read_audit_queue

    return lambda: read_audit_queue(endpoint.url)


def _errors() -> tuple[type[BaseException], ...]:
    from hascheduler.brokers.amqp.consumer import BROKER_ERRORS

    return BROKER_ERRORS


KIND = BrokerKind(
    name="RabbitMQ",
    schemes=frozenset({"amqp", "amqps"}),
    example="amqp://user:password@host:port/vhost",
    parse=AmqpEndpoint.parse,
    publisher=_publisher,
    consumer=_consumer,
    reader=_reader,
    errors=_errors,
)
