"""A RabbitMQ broker URL, parsed. aio-pika is imported only when a connection is made
(brokers/amqp/__init__.py says why)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, unquote, urlparse

if TYPE_CHECKING:
    from aio_pika.abc import AbstractConnection

OPTIONS = ("exchange", "celery_queue", "heartbeat")


@dataclass(frozen=True)
class AmqpEndpoint:
    """``amqp://user:password@host:port/vhost?options`` or ``amqps://...``. Options:
    exchange (the fires' topic exchange, default hascheduler), celery_queue (where
    ``celery:`` targets go unless their payload names a queue, default celery) and
    heartbeat (seconds)."""

    url: str  # for aio-pika, without our options
    exchange: str = "hascheduler"
    celery_queue: str = "celery"
    display: str = ""  # host:port/vhost, no credentials

    @classmethod
    def parse(cls, url: str) -> AmqpEndpoint:
        """Raises ValueError naming what is wrong with the URL."""
        parsed = urlparse(url)
        if parsed.scheme not in {"amqp", "amqps"}:
            raise ValueError(f"{url!r} is not an amqp:// or amqps:// URL")
        if not parsed.hostname:
            raise ValueError("the amqp:// broker URL names no host")
        try:
            port = parsed.port
        except ValueError:
            raise ValueError("the amqp:// broker URL's port is not a port number") from None
        query = {k: v[-1] for k, v in parse_qs(parsed.query, keep_blank_values=True).items()}
        unknown = set(query) - set(OPTIONS)
        if unknown:
            raise ValueError(
                f"unknown broker URL option(s) {', '.join(sorted(unknown))}: "
                f"use {', '.join(OPTIONS)}"
            )
        exchange = query.get("exchange", "hascheduler")
        if not exchange or len(exchange) > 255 or exchange.startswith("amq."):
            raise ValueError(
                f"exchange={exchange!r} in the broker URL: a name of 1 to 255 "
                "characters, not starting amq. (RabbitMQ's own)"
            )
        celery_queue = query.get("celery_queue", "celery")
        if not celery_queue or len(celery_queue) > 255:
            raise ValueError(
                f"celery_queue={celery_queue!r} in the broker URL: a name of 1 to 255 characters"
            )
        passed = ""
        if "heartbeat" in query:
            if not query["heartbeat"].isdigit():
                raise ValueError(
                    f"heartbeat={query['heartbeat']!r} in the broker URL is not "
                    "a whole number of seconds"
                )
            passed = f"?heartbeat={query['heartbeat']}"
        vhost = unquote(parsed.path[1:]) if len(parsed.path) > 1 else "/"
        host = parsed.hostname
        display = f"{host}:{port or (5671 if parsed.scheme == 'amqps' else 5672)}/{vhost}"
        return cls(
            url=url.split("?", 1)[0] + passed,
            exchange=exchange,
            celery_queue=celery_queue,
            display=display,
        )

    async def connect(self, timeout_s: float) -> AbstractConnection:
        import aio_pika

        return await aio_pika.connect(
            self.url, timeout=timeout_s, client_properties={"connection_name": "hascheduler"}
        )
