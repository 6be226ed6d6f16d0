"""Reading the fire stream back (audits): every message from the start with an ordered
consumer, and who leads the stream."""

from __future__ import annotations

import contextlib
import json

from hascheduler.brokers.base import SUBJECT_PREFIX, StoredFire
from hascheduler.brokers.nats.publisher import NatsEndpoint


async def read_stream(nats: str | NatsEndpoint, stream: str | None = None) -> list[StoredFire]:
    """Every message in the fire stream, read with an ordered consumer from the start, with
    the time JetStream stored it. ``nats`` is a broker URL (its TLS options too) or its
    endpoint; the stream is the URL's unless named."""
    endpoint = NatsEndpoint.parse(nats) if isinstance(nats, str) else nats
    stream = stream or endpoint.stream
    nc = await endpoint.connect("hascheduler-reader", connect_timeout=5)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        last = info.state.last_seq
        messages: list[StoredFire] = []
        if info.state.messages == 0:
            return messages
        sub = await js.subscribe(f"{SUBJECT_PREFIX}.>", ordered_consumer=True, stream=stream)
        try:
            while True:
                msg = await sub.next_msg(timeout=5)
                with contextlib.suppress(ValueError):
                    messages.append(StoredFire(json.loads(msg.data), msg.metadata.timestamp))
                if msg.metadata.sequence.stream >= last:
                    return messages
        finally:
            await sub.unsubscribe()
    finally:
        await nc.close()


async def stream_leader(nats_uri: str, stream: str | None = None) -> tuple[str | None, int]:
    """The server name of the node leading the fire stream (None on a server that is not
    clustered), and the stream's replica count."""
    endpoint = NatsEndpoint.parse(nats_uri)
    nc = await endpoint.connect("hascheduler-reader", connect_timeout=5)
    try:
        info = await nc.jetstream().stream_info(stream or endpoint.stream)
        leader = info.cluster.leader if info.cluster is not None else None
        return leader, int(info.config.num_replicas or 1)
    finally:
        await nc.close()
