"""Requests the leader answers as they come: fires run now (POST /schedules/{id}/trigger),
claimed and published once each, and the resume of schedules paused until an instant that
has passed (firing honours the instant on its own: Entry.paused_at; the resume makes the
schedule read as resumed)."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Mapping

import structlog

from hascheduler.core.clock import Clock
from hascheduler.core.entries import Entry
from hascheduler.replica.firing import CLAIM_BATCH, FiringPath
from hascheduler.replica.publishing import Publisher
from hascheduler.replica.term import Term
from hascheduler.storage.fire_records import REQUESTED
from hascheduler.storage.fires import Ledger
from hascheduler.storage.schedules import ScheduleStore

log = structlog.get_logger("hascheduler.dispatch")

# How often the leader takes the fires the API asked to run now.
REQUESTED_POLL_S = 0.25


class Requests:
    def __init__(
        self,
        ledger: Ledger,
        publisher: Publisher,
        store: ScheduleStore,
        firing: FiringPath,
        clock: Clock,
    ) -> None:
        self.ledger = ledger
        self.publisher = publisher
        self.store = store
        self.firing = firing
        self.clock = clock
        # Schedules paused until an instant, by id: the leader writes their resume once it
        # has passed.
        self.resumes: dict[str, dt.datetime] = {}

    def begin(self, entries: Mapping[str, Entry]) -> None:
        """A term begins: the pauses until an instant, as the mirror shows them."""
        self.resumes = {
            sid: e.paused_until
            for sid, e in entries.items()
            if e.paused and e.paused_until is not None
        }

    def changed(self, schedule_id: str, entry: Entry | None) -> dt.datetime | None:
        """A schedule changed (``entry``, None: deleted): the instant it was paused until
        before, if it was, and its pause's end from now on."""
        until = self.resumes.pop(schedule_id, None)
        if entry is not None and entry.paused and entry.paused_until is not None:
            self.resumes[schedule_id] = entry.paused_until
        return until

    async def run(self, term: Term) -> None:
        """Fires run now: claimed and published as they come. One claimed by a deposed
        leader is adopted like any claim. And the resume of schedules paused until an
        instant now passed."""
        while True:
            await asyncio.sleep(REQUESTED_POLL_S)
            term.check()
            await self._resume_ended_pauses()
            ids = await self.ledger.requested(CLAIM_BATCH)
            if ids:
                now = self.clock()
                await term.write(
                    self.ledger.take(ids, REQUESTED, term.number, now, self.firing.retry_at(now))
                )
                claims = await term.read(self.ledger.taken(ids, term.number))
                log.info("running_now", count=len(claims), term=term.number)
                term.add_pending(claims)  # its retries leave them to this publish
                try:
                    await self.publisher.publish(claims, term, attempt=1)
                finally:
                    term.remove_pending(claims)

    async def _resume_ended_pauses(self) -> None:
        if not self.resumes:
            return
        now = self.clock()
        for schedule_id, until in [(s, u) for s, u in self.resumes.items() if u <= now]:
            if await self.store.resume_at_end(schedule_id, until, now):
                log.info("pause_ended", schedule_id=schedule_id, until=until.isoformat())
            self.resumes.pop(schedule_id, None)
