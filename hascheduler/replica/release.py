"""Overlap release: buffered fires whose key's open run has ended, claimed and published
at once (the gate, replica/overlap.py, says which; invariant 11, docs/ARCHITECTURE.md)."""

from __future__ import annotations

import asyncio

import structlog

from hascheduler.core.clock import Clock
from hascheduler.replica.firing import FiringPath
from hascheduler.replica.overlap import BUFFER_POLL_S, OverlapGate
from hascheduler.replica.publishing import Publisher
from hascheduler.replica.term import Term

log = structlog.get_logger("hascheduler.dispatch")


class OverlapRelease:
    def __init__(
        self, gate: OverlapGate, publisher: Publisher, firing: FiringPath, clock: Clock
    ) -> None:
        self.gate = gate
        self.publisher = publisher
        self.firing = firing
        self.clock = clock

    async def run(self, term: Term) -> None:
        while True:
            await asyncio.sleep(BUFFER_POLL_S)
            term.check()
            claims = await self.gate.ready(term, self.firing.retry_at(self.clock()))
            if claims:
                log.info("released_buffered", count=len(claims), term=term.number)
                term.add_pending(claims)  # its retries leave them to this publish
                try:
                    await self.publisher.publish_released(claims, term)
                finally:
                    term.remove_pending(claims)
                    self.gate.released(claims)
