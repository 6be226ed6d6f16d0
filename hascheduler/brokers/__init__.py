"""Where fires go: a broker chosen by URL (``nats://...`` or ``log:``)."""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

from .base import Broker, BrokerUnavailable, FireMessage
from .log import LogBroker
from .nats import NatsBroker


def broker_from_url(url: str) -> Broker:
    """The broker a URL names. Raises ValueError naming what is wrong with the URL."""
    parsed = urlparse(url)
    if parsed.scheme == "log":
        return LogBroker()
    if parsed.scheme in {"nats", "tls"}:
        query = parse_qs(parsed.query)
        stream = query.get("stream", ["HASCHEDULER"])[0]
        window = query.get("dedup_window", ["600"])[0]
        try:
            dedup_window = float(window)
        except ValueError:
            raise ValueError(f"dedup_window={window!r} in the broker URL is not a number of "
                             "seconds") from None
        servers = url.split("?", 1)[0]
        return NatsBroker(servers, stream=stream, dedup_window_s=dedup_window)
    raise ValueError(f"unsupported broker URL {url!r}: use nats://host:port or log:")


__all__ = ["Broker", "BrokerUnavailable", "FireMessage", "LogBroker", "NatsBroker",
           "broker_from_url"]
