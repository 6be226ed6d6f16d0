"""A namespace's fire-rate quota (pure): at most ``limit`` fires a second, in bursts of at
most ``limit`` at once, by the fires' due times (GCRA: one theoretical arrival time per
namespace).

A fire over its namespace's quota is not refused but given the first slot the quota
allows, and the slot is reserved, so each fire is looked at once more at most; one that
would wait longer than ``max_delay_s`` is skipped instead (a namespace over its quota for
good must not pile up delay without end). Other namespaces' fires are untouched: the
decision is per namespace, and a deferred fire goes back into the queue at its slot
rather than holding the ones behind it.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

ADMIT, DEFER, SKIP = "admit", "defer", "skip"
# A burst may take this many seconds' worth of the quota at once.
BURST_S = 1.0
DEFAULT_MAX_DELAY_S = 60.0


@dataclass
class FireRates:
    max_delay_s: float = DEFAULT_MAX_DELAY_S
    _arrival: dict[str, dt.datetime] = field(default_factory=dict)  # namespace -> TAT

    def decide(
        self, namespace: str, limit: float | None, due: dt.datetime
    ) -> tuple[str, dt.datetime]:
        """ADMIT (at ``due``), DEFER to the returned slot (reserved), or SKIP."""
        if limit is None:
            return ADMIT, due
        interval = dt.timedelta(seconds=1 / limit)
        tolerance = dt.timedelta(seconds=BURST_S) - interval
        arrival = max(self._arrival.get(namespace, due), due)
        slot = max(due, arrival - tolerance)
        if (slot - due).total_seconds() > self.max_delay_s:
            return SKIP, due
        self._arrival[namespace] = arrival + interval
        return (ADMIT if slot == due else DEFER), slot
