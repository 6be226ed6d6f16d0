"""Quota admission: the fire loop's batch, each fire against its namespace's fire-rate
quota (the access file's ``max_fires_per_second``, core/quota.py), before it is claimed. Its
state is the term's: each term begins with none."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping

from hascheduler.core.entries import Entry
from hascheduler.core.fields import DEFAULT_NAMESPACE
from hascheduler.core.fire_queue import Due
from hascheduler.core.quota import ADMIT, DEFER, FireRates
from hascheduler.process.metrics import Metrics
from hascheduler.replica.firing import FiringPath
from hascheduler.replica.term import Term


class QuotaAdmission:
    def __init__(
        self,
        quota: Callable[[str], float | None],
        entries: Mapping[str, Entry],
        firing: FiringPath,
        metrics: Metrics,
    ) -> None:
        # A namespace's quota, read at each fire so that a change to the file applies at
        # once.
        self.quota = quota
        self.entries = entries  # the mirror's
        self.firing = firing
        self.metrics = metrics
        self.rates = FireRates()
        # Fires given a later slot by their quota, by (schedule, nominal): their slot is
        # reserved, so they go when they come back.
        self.reserved: set[tuple[str, dt.datetime]] = set()

    def begin(self) -> None:
        """A term begins: no fire of an earlier term counts against its quotas."""
        self.rates, self.reserved = FireRates(), set()

    async def admit(self, batch: list[Due], term: Term, now: dt.datetime) -> list[Due]:
        """The fires of ``batch`` their namespaces' quotas admit now; the others go back
        into the queue at their slot, or are recorded skipped (core/quota.py)."""
        admitted: list[Due] = []
        skipped: list[tuple[Due, str]] = []
        for due in batch:
            entry = self.entries.get(due.schedule_id)
            namespace = entry.namespace if entry is not None else DEFAULT_NAMESPACE
            limit = self.quota(namespace)
            if limit is None or (due.schedule_id, due.nominal) in self.reserved:
                self.reserved.discard((due.schedule_id, due.nominal))
                admitted.append(due)
                continue
            decision, slot = self.rates.decide(namespace, limit, due.fire_at)
            if decision == ADMIT:
                admitted.append(due)
            elif decision == DEFER:
                term.put_back(due, slot)
                self.reserved.add((due.schedule_id, due.nominal))
                self.metrics.quota_deferred.labels(namespace).inc()
            else:
                skipped.append(
                    (
                        due,
                        f"namespace {namespace!r} is over its quota of "
                        f"{limit:g} fires a second (max_fires_per_second)",
                    )
                )
        if skipped:
            await self.firing.record_refused(skipped, term, now)
        return admitted
