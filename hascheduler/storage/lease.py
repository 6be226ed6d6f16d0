"""Leader election: one lease document, compare-and-swap on the database's clock.

Acquire and renew are the same single findAndModify (invariant 3, docs/ARCHITECTURE.md): its filter
admits only the current holder or an expired lease, judged on the server's ``$$NOW``; its
update pipeline sets the holder and ``expires_at = $$NOW + ttl``, and bumps ``term`` (the
fencing token) whenever the holder changes. The holder is a process, not only a replica id:
``instance`` is new with every Lease object, so a process restarted under the same
``--replica-id`` (a StatefulSet's pod, a host name) waits for the lease to expire like any
other replica and takes it in a new term, and the old process, should it still run, is
fenced. Losing the race is a normal outcome (no match,
or a duplicate key on the upsert), never an error.

The holder may act only while its own monotonic clock says a renewal succeeded less than
``renew_deadline`` ago; ``renew_deadline < ttl`` means it stops before anyone else can
acquire, whatever the two machines' wall clocks say.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError

from hascheduler.core.clock import ServerClock
from hascheduler.core.errors import ConfigError
from hascheduler.core.instants import as_utc
from hascheduler.storage.collection import Collection

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


class LeaseSettingsError(ConfigError):
    """The timings cannot guarantee a single actor; the message names the setting."""


@dataclass(frozen=True)
class LeaseTimings:
    ttl: float = 10.0
    renew_deadline: float = 7.0
    renew_interval: float = 2.0

    def __post_init__(self) -> None:
        if not self.renew_interval > 0:
            raise LeaseSettingsError("renew interval must be greater than 0")
        if not self.renew_deadline > 1.2 * self.renew_interval:
            raise LeaseSettingsError(
                f"renew deadline ({self.renew_deadline:g}s) must exceed 1.2 x renew interval "
                f"({self.renew_interval:g}s), or one slow renewal costs the leadership"
            )
        if not self.ttl > self.renew_deadline:
            raise LeaseSettingsError(
                f"lease ttl ({self.ttl:g}s) must exceed the renew deadline "
                f"({self.renew_deadline:g}s), so a leader stops before others may take over"
            )


@dataclass(frozen=True)
class LeaseView:
    """The lease document as last read."""

    holder: str | None
    term: int
    expires_at: dt.datetime
    fired_through: dt.datetime | None = None

    @classmethod
    def from_document(cls, doc: dict[str, Any]) -> LeaseView:
        """The one reading of a lease document (the elector, the API, the dev cluster)."""
        return cls(
            holder=doc.get("holder"),
            term=int(doc.get("term", 0)),
            expires_at=as_utc(doc.get("expires_at", EPOCH)),
            fired_through=as_utc(doc.get("fired_through")),
        )

    def held_at(self, now: dt.datetime) -> bool:
        return self.holder is not None and self.expires_at > now


class Lease:
    """One replica's handle on the named lease."""

    def __init__(
        self,
        collection: Collection,
        name: str,
        holder: str,
        timings: LeaseTimings,
        monotonic: Callable[[], float] = time.monotonic,
        server_clock: ServerClock | None = None,
    ) -> None:
        self._coll = collection
        self.name = name
        self.holder = holder
        self.instance = uuid.uuid4().hex  # this process's hold, apart from its replica id
        self.timings = timings
        self._monotonic = monotonic
        # Each renewal's reply carries the server's time (renewed_at): a free sample.
        self._server_clock = server_clock
        self.term: int | None = None  # the term we last held (None: another replica holds it)
        self._valid_until = float("-inf")  # monotonic: when we must stop acting

    @property
    def valid(self) -> bool:
        """True while we hold the lease and our renew deadline has not passed."""
        return self._monotonic() < self._valid_until

    def remaining(self) -> float:
        return max(0.0, self._valid_until - self._monotonic())

    async def acquire_or_renew(self, fired_through: dt.datetime | None = None) -> LeaseView | None:
        """Try once; returns the lease if we hold it now, None if another replica does.

        ``fired_through`` (the dispatcher's watermark) is recorded only while renewing.
        Raises PyMongoError when the database cannot be reached.
        """
        started = self._monotonic()
        me, instance = self.holder, self.instance
        mine = {"$and": [{"$eq": ["$holder", me]}, {"$eq": ["$instance", instance]}]}
        fields: dict[str, Any] = {
            "term": {"$cond": [mine, "$term", {"$add": [{"$ifNull": ["$term", 0]}, 1]}]},
            "holder": me,
            "instance": instance,
            "expires_at": {"$add": ["$$NOW", int(self.timings.ttl * 1000)]},
            "acquired_at": {"$cond": [mine, "$acquired_at", "$$NOW"]},
            "renewed_at": "$$NOW",
        }
        if fired_through is not None:
            fields["fired_through"] = {"$cond": [mine, fired_through, "$fired_through"]}
        try:
            doc = await self._coll.find_one_and_update(
                {
                    "_id": self.name,
                    "$or": [
                        {"holder": me, "instance": instance},
                        {"$expr": {"$lt": ["$expires_at", "$$NOW"]}},
                    ],
                },
                [{"$set": fields}],
                upsert=True,
                return_document=ReturnDocument.AFTER,
            )
        except DuplicateKeyError:
            doc = None  # the lease exists and is held: the upsert lost, as it should
        renewed_at = as_utc(doc.get("renewed_at")) if doc is not None else None
        if self._server_clock is not None and isinstance(renewed_at, dt.datetime):
            self._server_clock.observe(started, self._monotonic(), renewed_at)
        if doc is None or doc.get("holder") != me or doc.get("instance") != instance:
            self.term = None
            self._valid_until = float("-inf")
            return None
        view = LeaseView.from_document(doc)
        self.term = view.term
        # Measured from when we *sent* the request: the server set expires_at later than
        # that, so we always stop before the lease can expire for anyone else.
        self._valid_until = started + self.timings.renew_deadline
        return view

    async def release(self, fired_through: dt.datetime | None) -> bool:
        """Expire our lease now (graceful handover). False if we no longer held it."""
        term = self.term
        self.term = None
        self._valid_until = float("-inf")
        if term is None:
            return False
        update: dict[str, Any] = {"expires_at": EPOCH, "released_at": "$$NOW"}
        if fired_through is not None:
            update["fired_through"] = fired_through
        result = await self._coll.update_one(
            {"_id": self.name, "holder": self.holder, "instance": self.instance, "term": term},
            [{"$set": update}],
        )
        return bool(result.modified_count)

    def step_down(self) -> None:
        """Stop acting at once. The term is kept, so ``release`` can still expire it."""
        self._valid_until = float("-inf")

    async def read(self) -> LeaseView | None:
        return await read_lease(self._coll, self.name)


async def read_lease(leases: Collection, name: str) -> LeaseView | None:
    """The lease ``name`` as the database holds it, if any."""
    doc = await leases.find_one({"_id": name})
    return LeaseView.from_document(doc) if doc else None
