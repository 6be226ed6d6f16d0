"""A broker that writes one structured log line per fire: for demos and tests.

It keeps the broker contract (base.Broker) like any other: one outcome per message, a
fire id stored once within its deduplication window, a message with an unusable target
failing alone."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence

import structlog

from hascheduler.brokers.base import FireMessage
from hascheduler.core.constants import TARGET_PATTERN

log = structlog.get_logger("hascheduler.fire")

# Fire ids remembered for deduplication, as a broker's duplicate window would.
DEDUP_WINDOW = 100_000


class UnusableTarget(ValueError):
    """A target that is not dot-separated tokens (constants.TARGET_PATTERN)."""


class LogPublisher:
    def __init__(self) -> None:
        self._seen: OrderedDict[str, None] = OrderedDict()

    async def start(self) -> None:
        return None

    async def publish(
        self, messages: Sequence[FireMessage], timeout_s: float
    ) -> list[BaseException | None]:
        outcomes: list[BaseException | None] = []
        for message in messages:
            if not TARGET_PATTERN.fullmatch(message.target):
                outcomes.append(UnusableTarget(f"target {message.target!r}"))
                continue
            outcomes.append(None)
            if message.fire_id in self._seen:
                continue  # a republish: acknowledged, stored once
            self._seen[message.fire_id] = None
            if len(self._seen) > DEDUP_WINDOW:
                self._seen.popitem(last=False)
            log.info(
                "fire",
                fire_id=message.fire_id,
                target=message.target,
                term=message.term,
                nominal_at=_nominal(message.body),
            )
        return outcomes

    async def close(self) -> None:
        return None


def _nominal(body: bytes) -> object:
    try:
        return json.loads(body)["data"]["nominal_at"]
    except (ValueError, KeyError, TypeError):
        return None
