"""RabbitMQ (AMQP 0-9-1): fires on a topic exchange, Celery task messages for celery:
targets, quorum queues for workers."""

from __future__ import annotations

import aiormq.exceptions

from hascheduler.brokers.amqp.publisher import AmqpEndpoint, AmqpPublisher
from hascheduler.brokers.amqp.reader import read_audit_queue
from hascheduler.brokers.amqp.source import AmqpSource
from hascheduler.brokers.base import BrokerKind, FireReader, FireSource


def _source(endpoint: AmqpEndpoint, ack_wait_s: float) -> FireSource:
    # Missed heartbeats close the connection and requeue what it held: a stalled worker's
    # fires go to another within about the ack wait.
    return AmqpSource(endpoint, heartbeat_s=max(1, round(ack_wait_s / 3)))


def _reader(endpoint: AmqpEndpoint) -> FireReader:
    return lambda: read_audit_queue(endpoint.url)


KIND = BrokerKind(
    name="RabbitMQ", schemes=frozenset({"amqp", "amqps"}),
    example="amqp://user:password@host:port/vhost", parse=AmqpEndpoint.parse,
    publisher=AmqpPublisher, source=_source, reader=_reader,
    errors=(aiormq.exceptions.AMQPError, aiormq.exceptions.ChannelInvalidStateError, OSError,
            TimeoutError))
