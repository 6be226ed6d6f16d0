"""Fires from NATS JetStream: a durable pull consumer on the fire stream, shared by every
worker with the same durable name. JetStream does the waiting for ``nak(delay)``,
redelivers after the ack wait, and keeps a message in progress on request."""

from __future__ import annotations

from typing import Any

import structlog
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from hascheduler.brokers.base import SUBJECT_PREFIX
from hascheduler.brokers.nats.publisher import NatsEndpoint, ensure_stream

log = structlog.get_logger("hascheduler.worker")


async def _disconnected() -> None:
    log.warning("broker_disconnected")


async def _reconnected() -> None:
    log.info("broker_reconnected")


class NatsSource:
    pushes = False  # a pull consumer's fetch asks for a batch

    def __init__(self, endpoint: NatsEndpoint) -> None:
        self.endpoint = endpoint
        self._nc: Any = None
        self._subscription: Any = None

    async def connect(self, name: str) -> None:
        self._nc = await self.endpoint.connect(
            name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
            disconnected_cb=_disconnected, reconnected_cb=_reconnected)

    async def subscribe(self, durable: str, patterns: list[str], ack_wait_s: float,
                        in_flight: int) -> None:
        """Creating the stream and the durable consumer if they are gone."""
        js = self._nc.jetstream()
        await ensure_stream(js, self.endpoint)
        subjects = [f"{SUBJECT_PREFIX}.{p}" for p in patterns]
        await js.add_consumer(self.endpoint.stream, ConsumerConfig(
            durable_name=durable, ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL, ack_wait=ack_wait_s, max_deliver=-1,
            max_ack_pending=max(1000, 4 * in_flight),
            **({"filter_subject": subjects[0]} if len(subjects) == 1
               else {"filter_subjects": subjects})))
        self._subscription = await js.pull_subscribe_bind(durable=durable,
                                                          stream=self.endpoint.stream)

    async def fetch(self, up_to: int, wait_s: float) -> list[Any]:
        try:
            return list(await self._subscription.fetch(up_to, timeout=wait_s))
        except TimeoutError:  # an idle stream (nats-py's TimeoutError is one too)
            return []

    async def close(self) -> None:
        # Every message is acknowledged explicitly, so nothing is left to drain from the
        # connection; drain() on a pull subscription can wait forever.
        if self._nc is not None:
            await self._nc.close()
