"""The leader's overlap gate (invariant 11, docs/ARCHITECTURE.md): before a fire of a
schedule with an overlap policy is published, read that schedule's open runs and waiting
fires, let core/overlap.py decide, record what it decided, and reserve a ``pending`` run
for each fire let through, so the next decision sees it open.

The leader learns that runs ended by asking the runs ledger, never from a stream of every
run's changes: at a fire (one query per batch, and only for schedules with a policy), and,
while fires wait, every BUFFER_POLL_S for the keys they wait on. Schedules without a
policy (``allow``) pass untouched, with no database round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import Callable, Mapping

import structlog

from hascheduler.core.claims import Claim
from hascheduler.core.entries import Entry
from hascheduler.core.errors import RunConflict, RunNotFound
from hascheduler.core.overlap import ALLOW, Candidate, Key, decide
from hascheduler.process.metrics import Metrics
from hascheduler.storage.fires import BUFFERED, Ledger
from hascheduler.storage.runs import RunLedger

log = structlog.get_logger("hascheduler.dispatch")

# How often the leader looks whether a waiting fire's open run has ended, while any waits:
# a buffered fire is published within this (plus a round trip) of the run's end.
BUFFER_POLL_S = 0.05

class OverlapGate:
    def __init__(self, ledger: Ledger, runs: RunLedger, entries: Mapping[str, Entry],
                 max_buffered: int, clock: Callable[[], dt.datetime], metrics: Metrics) -> None:
        self.ledger = ledger
        self.runs = runs
        self.entries = entries
        self.max_buffered = max_buffered
        self.clock = clock
        self.metrics = metrics
        # One decision at a time: two batches deciding at once would each find no open run.
        self._deciding = asyncio.Lock()
        self.waiting: set[Key] = set()  # keys with buffered fires (this term's view)

    def policy(self, claim: Claim) -> str:
        if claim.overlap is not None:
            return claim.overlap
        entry = self.entries.get(claim.schedule_id)
        return entry.overlap if entry is not None else ALLOW

    async def begin(self) -> None:
        """A term begins: learn which keys have fires waiting (an older term's)."""
        self.waiting = await self.ledger.buffered_keys()

    async def admit(self, claims: list[Claim], targets: Mapping[str, str], term: int,
                    released: bool = False) -> list[Claim]:
        """The claims to publish now; the others are recorded skipped or buffered.
        ``released`` fires were buffered and their wait is over: they go ahead of the
        fires still waiting."""
        governed = [c for c in claims if self.policy(c) != ALLOW]
        if not governed:
            return claims
        async with self._deciding:
            ids = sorted({c.schedule_id for c in governed})
            open_runs = await self.runs.open_runs(ids)
            buffered = {} if released else await self.ledger.buffered_counts(ids)
            decision = decide([Candidate(c.fire_id, (c.schedule_id, c.tenant), c.nominal_at,
                                         self.policy(c)) for c in governed],
                              open_runs, buffered, self.max_buffered)
            now = self.clock()
            if decision.skip:
                await self.ledger.skip_overlapping(decision.skip, term)
                self.metrics.fires.labels("skipped").inc(len(decision.skip))
                log.info("skipped_overlap", count=len(decision.skip), term=term)
            if decision.buffer:
                await self.ledger.buffer(decision.buffer, term, now)
                self.waiting.update((c.schedule_id, c.tenant) for c in governed
                                    if c.fire_id in decision.buffer)
                log.info("buffered", count=len(decision.buffer), term=term)
            for fire in sorted(decision.cancel):
                # One that ended meanwhile needs nothing: the buffered fire goes at the next
                # poll.
                with contextlib.suppress(RunConflict, RunNotFound):
                    await self.runs.cancel(fire, now, "overlap policy cancel_other")
            go = set(decision.publish)
            await self.runs.reserve([c for c in governed if c.fire_id in go], targets, now)
        return [c for c in claims if c.fire_id in go or self.policy(c) == ALLOW]

    async def ready(self, term: int, retry_at: dt.datetime) -> list[Claim]:
        """Buffered fires whose key has no open run any more, claimed for ``term``: the
        earliest waiting fire of each such key."""
        if not self.waiting:
            return []
        keys = set(self.waiting)
        open_keys = set(await self.runs.open_runs(sorted({k[0] for k in keys})))
        free = [k for k in keys if k not in open_keys]
        if not free:
            return []
        firsts = await self.ledger.first_buffered(free)
        for key in free:
            if key not in firsts:
                self.waiting.discard(key)  # nothing waits there any more
        return await self.ledger.take(sorted(firsts.values()), BUFFERED, term, self.clock(),
                                      retry_at)
