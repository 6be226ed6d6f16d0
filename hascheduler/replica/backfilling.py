"""A term's backfills (POST /schedules/{id}/backfill): the running ones worked a chunk of
nominal times at a time, in the quiet between the regular fires' publishes, each chunk's
counts read back from the ledger (core/backfill.py) so that they are exact across a
failover and a pause. A backfill waits while its schedule is paused; a claim of it that a
pause withdrew before its publish is freed, and fired after the resume."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import structlog

from hascheduler.core.backfill import ChunkOutcome, chunk_outcome
from hascheduler.core.claims import PAUSED_BEFORE_DUE
from hascheduler.core.clock import Clock
from hascheduler.core.entries import Entry
from hascheduler.core.fire_queue import Due
from hascheduler.core.instants import as_utc
from hascheduler.core.triggers import fire_times, just_before
from hascheduler.replica.term import Term
from hascheduler.storage.backfills import Backfills
from hascheduler.storage.fires import Ledger

log = structlog.get_logger("hascheduler.dispatch")

# Backfills are worked a chunk of nominal times per running backfill at most every
# BACKFILL_INTERVAL_S (1,000 fires a second each at most), and only in the quiet between
# the regular fires' publishes: never while half the publish slots await the broker, and
# not when a regular publish or claim is due within BACKFILL_QUIET_S (a chunk's claims and
# publishes then land between the bursts of a cron's seconds instead of in front of
# them). A backfill takes a bounded share of the firing path, and the regular fires go
# first; when they leave no quiet at all, it still works a chunk every
# BACKFILL_MAX_WAIT_S.
BACKFILL_CHUNK = 500
BACKFILL_INTERVAL_S = 0.5
BACKFILL_POLL_S = 0.05
BACKFILL_QUIET_S = 0.3
BACKFILL_MAX_WAIT_S = 2.0


class ClaimAndPublish(Protocol):
    """The firing path's claim of a batch of fires, published when due (its counts)."""

    async def __call__(
        self,
        batch: list[Due],
        term: Term,
        now: dt.datetime,
        may_defer: bool = True,
        overlap: str | None = None,
        backfill: str | None = None,
        published: list[asyncio.Task[None]] | None = None,
    ) -> tuple[int, int]: ...


class Backfilling:
    """The backfill work of a term (a service of it)."""

    def __init__(
        self,
        backfills: Backfills,
        ledger: Ledger,
        entries: Mapping[str, Entry],
        claim: ClaimAndPublish,
        busy: Callable[[], bool],
        clock: Clock,
        claim_ahead_s: float,
    ) -> None:
        self.backfills = backfills
        self.ledger = ledger
        self.entries = entries  # the mirror's
        self.claim = claim
        self.busy = busy  # the fires due now await the broker: they go first
        self.clock = clock
        self.claim_ahead_s = claim_ahead_s  # the queue's fires are claimed this far ahead

    async def run(self, term: Term) -> None:
        loop = asyncio.get_running_loop()
        worked = loop.time() - BACKFILL_INTERVAL_S
        while True:
            await asyncio.sleep(BACKFILL_POLL_S)
            term.check()
            since = loop.time() - worked
            # Regular fires so dense that the path is never quiet still leave a backfill
            # a chunk every BACKFILL_MAX_WAIT_S: slower, never stopped.
            if since < BACKFILL_INTERVAL_S or self.busy():
                continue  # busy: the fires due now wait for the broker, they go first
            if since < BACKFILL_MAX_WAIT_S and not self.quiet(term):
                continue
            worked = loop.time()
            for doc in await self.backfills.running(limit=10):
                await self.chunk(doc, term)

    def quiet(self, term: Term) -> bool:
        """No regular fire needs the firing path soon: no publish or claim is due within
        BACKFILL_QUIET_S."""
        publish_at = term.next_publish_at()
        claim_at = term.queue.first_at()
        if claim_at is not None:
            claim_at -= dt.timedelta(seconds=self.claim_ahead_s)
        soon = self.clock() + dt.timedelta(seconds=BACKFILL_QUIET_S)
        return all(t is None or t > soon for t in (publish_at, claim_at))

    async def chunk(self, doc: dict[str, Any], term: Term) -> ChunkOutcome | None:
        """The next chunk of a backfill's nominal times: claimed (a time the ledger holds
        is not fired again), published now and counted from the ledger, its progress
        recorded; None while its schedule is paused (nothing done)."""
        now = self.clock()
        schedule_id = doc["schedule_id"]
        entry = self.entries.get(schedule_id)
        end = as_utc(doc["end"])
        if entry is None:  # deleted since: nothing more to fire
            await self.backfills.advance(doc["_id"], end, 0, 0, True, now)
            return ChunkOutcome(end)
        cursor = as_utc(doc["cursor"])
        if entry.paused_now(now):
            return None  # waits for the resume
        nominals = [
            n
            for n in fire_times(
                entry.trigger, just_before(cursor), until=end, limit=BACKFILL_CHUNK + 1
            )
            if n < end
        ]
        # The cursor is the next nominal time itself (stored to the millisecond, as the
        # instants are): one a microsecond past the chunk's last was read back as that one.
        following = nominals[BACKFILL_CHUNK] if len(nominals) > BACKFILL_CHUNK else end
        nominals = nominals[:BACKFILL_CHUNK]
        outcome = ChunkOutcome(following)
        if nominals:
            # Due now, not at their nominal times: they are late by design, and the
            # lateness of the trigger's fires is what the metric is about.
            dues = [Due(now, n, schedule_id, entry.revision) for n in nominals]
            published: list[asyncio.Task[None]] = []
            await self.claim(
                dues,
                term,
                now,
                may_defer=False,
                overlap=doc.get("overlap"),
                backfill=doc["_id"],
                published=published,
            )
            if published:  # each ends published, buffered, skipped or left for a retry
                await asyncio.wait(published)
            outcome = chunk_outcome(
                await term.read(self.ledger.backfilled(schedule_id, nominals)),
                doc["_id"],
                following,
            )
            if outcome.released:
                await term.write(
                    self.ledger.release(outcome.released, term.number, PAUSED_BEFORE_DUE)
                )
        await self.backfills.advance(
            doc["_id"],
            outcome.cursor,
            outcome.fired,
            outcome.held,
            outcome.cursor >= end,
            now,
            outcome.withdrawn,
        )
        if outcome.fired or outcome.released:
            log.info(
                "backfilled",
                backfill=doc["_id"],
                fired=outcome.fired,
                skipped=outcome.held,
                withdrawn=sum(outcome.withdrawn.values()),
                freed_after_pause=len(outcome.released),
                term=term.number,
            )
        return outcome
