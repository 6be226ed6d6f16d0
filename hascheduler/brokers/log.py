"""A broker that writes one structured log line per fire: for demos and tests."""

from __future__ import annotations

import json
from collections.abc import Sequence

import structlog

from .base import FireMessage

log = structlog.get_logger("hascheduler.fire")


class LogBroker:
    async def start(self) -> None:
        return None

    async def publish(self, messages: Sequence[FireMessage],
                      timeout_s: float) -> list[BaseException | None]:
        for message in messages:
            event = json.loads(message.body)
            log.info("fire", fire_id=message.fire_id, target=message.target,
                     term=message.term, nominal_at=event["data"]["nominal_at"])
        return [None] * len(messages)

    async def close(self) -> None:
        return None
