"""The leader's overlap gate (invariant 11, docs/ARCHITECTURE.md): before a fire of a
schedule with an overlap policy is published, reserve a ``pending`` run for it, which the
runs ledger's unique ``open_key`` refuses while another run of its key is open; from what
was refused (and the fires waiting, which keep their place), core/overlap.py decides, and
the gate records what it decided.

The leader learns that runs ended by asking the runs ledger, never from a stream of every
run's changes: at a fire (the reservation: one insert per batch, and only for schedules
with a policy), and, while fires wait, every BUFFER_POLL_S for the keys they wait on.
Schedules without a policy (``allow``) pass untouched, with no database round trip.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Coroutine, Mapping
from typing import Any, Protocol, TypeVar

import pymongo
import structlog
from pymongo.errors import PyMongoError

from hascheduler.core.claims import Claim
from hascheduler.core.clock import Clock
from hascheduler.core.entries import Entry
from hascheduler.core.errors import RunConflict, RunNotFound
from hascheduler.core.overlap import ALLOW, Candidate, Key, decide
from hascheduler.process.metrics import Metrics
from hascheduler.replica.term import LeadershipLost
from hascheduler.storage.fire_records import BUFFERED
from hascheduler.storage.fires import Ledger
from hascheduler.storage.reservations import open_key
from hascheduler.storage.runs import RunLedger

log = structlog.get_logger("hascheduler.dispatch")

# How often the leader looks whether a waiting fire's open run has ended, while any waits:
# a buffered fire is published within this (plus a round trip) of the run's end.
BUFFER_POLL_S = 0.05
# How long a deposed term tries to withdraw the reservations it made as it lost the lease.
WITHDRAW_TIMEOUT_S = 2.0
# How often, while fires wait or are refused, the leader looks whether what holds them is
# such a reservation that a term killed before withdrawing it left.
STALE_CHECK_S = 1.0

T = TypeVar("T")


class Fenced(Protocol):
    """The leader's term, as far as the gate goes: its number, whether it still holds the
    lease, and its reads and writes, each bounded by what remains of the term
    (replica/term.py)."""

    @property
    def number(self) -> int: ...

    @property
    def holds(self) -> bool: ...

    async def read(self, work: Coroutine[Any, Any, T]) -> T: ...

    async def write(self, work: Coroutine[Any, Any, T]) -> T: ...


class OverlapGate:
    def __init__(
        self,
        ledger: Ledger,
        runs: RunLedger,
        entries: Mapping[str, Entry],
        max_buffered: int,
        clock: Clock,
        metrics: Metrics,
    ) -> None:
        self.ledger = ledger
        self.runs = runs
        self.entries = entries
        self.max_buffered = max_buffered
        self.clock = clock
        self.metrics = metrics
        self.waiting: set[Key] = set()  # keys with buffered fires (this term's view)
        # Keys whose earliest waiting fire ready() took and admit() has not yet reserved a
        # run for: a fire of the key arriving meanwhile waits behind it (buffer_all keeps
        # nominal order), though the database shows neither a buffered fire nor an open run.
        self.releasing: set[Key] = set()
        self._stale_check_at = 0.0  # monotonic: when it next looks for stale reservations

    def policy(self, claim: Claim) -> str:
        if claim.overlap is not None:
            return claim.overlap
        entry = self.entries.get(claim.schedule_id)
        return entry.overlap if entry is not None else ALLOW

    def _paused(self, schedule_id: str, now: dt.datetime) -> bool:
        entry = self.entries.get(schedule_id)
        return entry is not None and entry.paused_now(now)

    async def begin(self) -> None:
        """A term begins: learn which keys have fires waiting (an older term's)."""
        self.waiting = await self.ledger.buffered_keys()

    async def admit(
        self, claims: list[Claim], targets: Mapping[str, str], term: Fenced, released: bool = False
    ) -> list[Claim]:
        """The claims to publish now; the others are recorded skipped or buffered.
        ``released`` fires were buffered and their wait is over: they go ahead of the
        fires still waiting."""
        return (await self._admit(claims, targets, term, released, hold=False))[0]

    async def admit_ahead(
        self, claims: list[Claim], targets: Mapping[str, str], term: Fenced
    ) -> tuple[list[Claim], list[Claim]]:
        """Before the claims' due time: (those to publish at it, those held). A fire that
        does not reserve its key's run now (that run still open, fires waiting, an earlier
        fire of its key in the batch) is held, nothing recorded, to ask again at its due
        time (``admit``): its fire is then, and a run may end before it."""
        return await self._admit(claims, targets, term, False, hold=True)

    async def _admit(  # noqa: C901 (the gate's one decision path, kept whole)
        self,
        claims: list[Claim],
        targets: Mapping[str, str],
        term: Fenced,
        released: bool,
        hold: bool,
        again: bool = False,
    ) -> tuple[list[Claim], list[Claim]]:
        governed = [c for c in claims if self.policy(c) != ALLOW]
        if not governed:
            return claims, []
        keys = {(c.schedule_id, c.tenant) for c in governed}
        waiting = set() if released else keys & self.waiting
        buffered = (
            {
                k: n
                for k, n in (
                    await self.ledger.buffered_counts(sorted({k[0] for k in waiting}))
                ).items()
                if k in waiting
            }
            if waiting
            else {}
        )
        if not released:
            for key in keys & self.releasing:
                buffered[key] = buffered.get(key, 0) + 1
        # A fire with a run of its own was let through before (its publish failed, its
        # leader was deposed, its mark lost): it goes, as reserve() lets it when nothing
        # waits. Decided anew behind the fires buffered since, it was skipped: its own
        # reservation held the key for ever, or its first publish had landed.
        # Where it is the one to check (several fires of a key, or fires waiting): with one
        # fire a key and none waiting, reserve() finds its run itself.
        own: set[str] = set()
        if buffered or len(keys) < len(governed):
            own = await self.runs.with_runs([c.fire_id for c in governed])
            await self.runs.adopt(sorted(own), term.number)
            governed = [c for c in governed if c.fire_id not in own]
            keys = {(c.schedule_id, c.tenant) for c in governed}
        # The earliest fire of each key with nothing waiting asks the database for the
        # key's one open run; a key already open refuses it, naming its open run.
        first: dict[Key, Claim] = {}
        if not buffered and len(keys) == len(governed):
            first = {(c.schedule_id, c.tenant): c for c in governed}  # one fire per key
        else:
            for claim in sorted(governed, key=lambda c: (c.nominal_at, c.fire_id)):
                key = (claim.schedule_id, claim.tenant)
                if key not in first and not buffered.get(key):
                    first[key] = claim
        now = self.clock()
        # Held fires record nothing, so what holds them need not be named.
        refused = await self._reserve(list(first.values()), targets, now, term, hold)
        if hold:
            # Ahead of the due time nothing is decided: a fire that did not reserve its
            # key's run is asked again at its due time. Buffered now, a fire a run ahead of
            # it in the same batch ended was released, and published, before it was due.
            went = {c.fire_id for c in first.values() if c.fire_id not in refused}
            held = [c for c in governed if c.fire_id not in went]
            gone = {c.fire_id for c in held}
            return [c for c in claims if c.fire_id not in gone], held
        if not again and any(not blocker for blocker in refused.values()):
            # The run that refused a fire ended before it could be named: its key is free
            # now, and the fires are decided again (once), never skipped naming no run.
            return await self._admit(claims, targets, term, released, hold, again=True)
        if refused and time.monotonic() >= self._stale_check_at:
            # What refused them may be a reservation no term will publish; withdrawn, the
            # fires are decided again (once: the next look is STALE_CHECK_S away).
            self._stale_check_at = time.monotonic() + STALE_CHECK_S
            blocking = {fire: blocker for fire, blocker in refused.items() if blocker}
            if len(await self._without_stale(blocking, term)) < len(blocking):
                return await self._admit(claims, targets, term, released, hold)
        if not refused and len(first) == len(governed):
            # Each fire holds its key's open run now: all go (as decide() would say).
            if released:
                self.releasing -= keys
            return claims, []
        open_runs: dict[Key, list[str]] = {
            key: [refused[c.fire_id]] for key, c in first.items() if c.fire_id in refused
        }
        if buffered:  # what those keys wait for, for the record
            blockers = await self.runs.open_runs(sorted(open_key(*k) for k in buffered))
            for key in buffered:
                open_runs.setdefault(key, [blockers.get(open_key(*key), "")])
        decision = decide(
            [
                Candidate(c.fire_id, (c.schedule_id, c.tenant), c.nominal_at, self.policy(c))
                for c in governed
            ],
            open_runs,
            buffered,
            self.max_buffered,
        )
        if decision.skip:
            await self.ledger.skip_overlapping(decision.skip, term.number)
            self.metrics.fires.labels("skipped").inc(len(decision.skip))
            log.info("skipped_overlap", count=len(decision.skip), term=term.number)
        if decision.buffer:
            await self.ledger.buffer(decision.buffer, term.number, now)
            self.waiting.update(
                (c.schedule_id, c.tenant) for c in governed if c.fire_id in decision.buffer
            )
            log.info("buffered", count=len(decision.buffer), term=term.number)
        for fire in sorted(decision.cancel):
            # One that ended meanwhile needs nothing: the buffered fire goes at the next
            # poll.
            with contextlib.suppress(RunConflict, RunNotFound):
                await self.runs.cancel(fire, now, "overlap policy cancel_other")
        go = set(decision.publish) | own
        if released:
            self.releasing -= keys
        return [c for c in claims if c.fire_id in go or self.policy(c) == ALLOW], []

    async def _reserve(
        self,
        first: list[Claim],
        targets: Mapping[str, str],
        now: dt.datetime,
        term: Fenced,
        hold: bool,
    ) -> dict[str, str]:
        """``runs.reserve`` for ``term``, fenced: a term deposed before the answer lets
        nothing through and withdraws what it reserved. A reservation that lands after a
        newer term decided its fire (recorded it skipped, or buffered it behind the run
        it was refused on) is neither published nor left to hold its key; one that landed
        before is what the newer term finds and publishes (the fire's own run)."""
        refused: dict[str, str] | None = None
        with contextlib.suppress(LeadershipLost):  # out of time: it may land yet
            refused = await term.write(
                self.runs.reserve(first, targets, now, term.number, name_blockers=not hold)
            )
        if refused is not None and term.holds:
            return refused
        with contextlib.suppress(PyMongoError), pymongo.timeout(WITHDRAW_TIMEOUT_S):
            await self.runs.withdraw(
                [c.fire_id for c in first if refused is None or c.fire_id not in refused],
                term.number,
            )
        raise LeadershipLost

    async def _without_stale(self, held: dict[str, str], term: Fenced) -> dict[str, str]:
        """``held`` (open key -> its run's fire) less the reservations left by a term
        killed between a reservation that landed late and its withdrawal: a ``pending`` run
        whose fire is recorded skipped, failed or buffered, which no term will publish.
        They are withdrawn."""
        pending = await term.read(self.runs.pending(sorted(held.values())))
        stale = await term.read(self.ledger.undone(sorted(pending))) if pending else set()
        if not stale:
            return held
        await term.write(self.runs.withdraw_stale(sorted(stale)))
        log.warning("stale_reservations_withdrawn", count=len(stale), term=term.number)
        return {key: fire for key, fire in held.items() if fire not in stale}

    def released(self, claims: list[Claim]) -> None:
        """Claims ready() handed out are through admit() (or will never reach it)."""
        self.releasing -= {(c.schedule_id, c.tenant) for c in claims}

    async def unreserve(self, claims: list[Claim], term: int) -> None:
        """Claims it let through that will not be published after all (skipped at their
        due time, failed, over max_fires): their reserved runs are not open."""
        for claim in claims:
            if self.policy(claim) != ALLOW:
                await self.runs.unreserve(claim.fire_id, term)

    async def ready(self, term: Fenced, retry_at: dt.datetime) -> list[Claim]:
        """Buffered fires whose key has no open run any more, claimed for ``term``: the
        earliest waiting fire of each such key."""
        if not self.waiting:
            return []
        # A paused schedule publishes nothing: its buffered fires wait for the resume.
        now = self.clock()
        keys = {k for k in self.waiting if not self._paused(k[0], now)}
        if not keys:
            return []
        held = await term.read(self.runs.open_runs(sorted(open_key(*k) for k in keys)))
        if held and time.monotonic() >= self._stale_check_at:
            self._stale_check_at = time.monotonic() + STALE_CHECK_S
            held = await self._without_stale(held, term)
        free = [k for k in keys if open_key(*k) not in held]
        if not free:
            return []
        firsts = await term.read(self.ledger.first_buffered(free))
        for key in free:
            if key not in firsts:
                self.waiting.discard(key)  # nothing waits there any more
        # Releasing from before the take: once a fire is taken, the database shows its key
        # neither a buffered fire nor an open run until admit() reserves its run.
        self.releasing.update(firsts)
        ids = sorted(firsts.values())
        try:
            await term.write(self.ledger.take(ids, BUFFERED, term.number, self.clock(), retry_at))
            taken = await term.read(self.ledger.taken(ids, term.number))
        except BaseException:
            self.releasing.difference_update(firsts)
            raise
        self.releasing.difference_update(set(firsts) - {(c.schedule_id, c.tenant) for c in taken})
        return taken
