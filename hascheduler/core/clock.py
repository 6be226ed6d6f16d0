"""The database server's clock, as seen from this process (invariant 12,
docs/ARCHITECTURE.md).

A replica decides when a fire is due, and a worker when a run's lease lapsed; the lease
itself is judged on the server's ``$$NOW``. Deciding on the local wall clock makes a
replica whose clock runs ahead fire early. So each process keeps bounds on the server's
time instead, from replies that carry it (the lease's ``renewed_at``, ``hello``'s
``localTime``) and its own monotonic clock:

A reply sent at monotonic ``s`` and received at ``r``, saying the server read ``T`` (whole
milliseconds, truncated) at some moment in between, tells us that at a later monotonic
``m`` the server's clock reads at least ``T + (m - r)`` and less than
``T + 1 ms + (m - s)``, widened by the monotonic clock's possible drift. Each bound is kept
from the sample that makes it tightest. The wall clock is never read for a decision: it may
be wrong, or stepped, by any amount.

``now()`` is the lower bound, the earliest the server's clock can read: a fire published
when ``now()`` reaches its due time is never early by the server's clock. A process whose
bounds are wider than its tolerance must not lead (``problem``).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass

# What every part that reads the time is given: a function of now (the server's clock,
# ServerClock.now, in a replica and a worker).
Clock = Callable[[], dt.datetime]

# How far the monotonic clock may run fast or slow against the server's: NTP slews a clock
# by at most 500 ppm, and crystals drift by tens.
MAX_DRIFT = 500e-6
# BSON dates have whole milliseconds; the server truncates.
RESOLUTION_S = 0.001
DEFAULT_TOLERANCE_S = 0.25


@dataclass(frozen=True)
class _Bound:
    server: dt.datetime  # what the server's clock read (lower) or may have read (upper)
    at: float  # at this monotonic instant


class ServerClock:
    """Bounds on the database server's clock, kept from the replies that carry it."""

    def __init__(
        self,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Clock = lambda: dt.datetime.now(dt.UTC),
        drift: float = MAX_DRIFT,
        tolerance_s: float = DEFAULT_TOLERANCE_S,
    ) -> None:
        self.monotonic = monotonic  # samplers time their round trips with it
        self._wall = wall
        self._drift = drift
        self.tolerance_s = tolerance_s
        self._lower: _Bound | None = None
        self._upper: _Bound | None = None
        self.samples = 0
        self.resets = 0  # samples that contradicted the bounds (the server's clock stepped)

    def observe(self, sent: float, received: float, server: dt.datetime) -> None:
        """A reply sent at monotonic ``sent``, received at ``received``, carrying the
        server's time ``server`` (read somewhere in between)."""
        if received < sent:
            return
        self.samples += 1
        lower = _Bound(server, received)
        upper = _Bound(server + dt.timedelta(seconds=RESOLUTION_S), sent)
        if self._lower is None or self._upper is None:
            self._lower, self._upper = lower, upper
            return
        m = received
        new_low, new_high = self._low_at(lower, m), self._high_at(upper, m)
        if new_low > self._high_at(self._upper, m) or new_high < self._low_at(self._lower, m):
            # Disjoint: the server's clock was stepped (or a new server answers). The
            # newest sample is the truth now.
            self.resets += 1
            self._lower, self._upper = lower, upper
            return
        if new_low > self._low_at(self._lower, m):
            self._lower = lower
        if new_high < self._high_at(self._upper, m):
            self._upper = upper

    def _low_at(self, bound: _Bound, m: float) -> dt.datetime:
        return bound.server + dt.timedelta(seconds=(m - bound.at) * (1 - self._drift))

    def _high_at(self, bound: _Bound, m: float) -> dt.datetime:
        return bound.server + dt.timedelta(seconds=(m - bound.at) * (1 + self._drift))

    @property
    def known(self) -> bool:
        return self._lower is not None

    def now(self) -> dt.datetime:
        """The earliest the server's clock can read now; the local wall clock before the
        first sample (nothing may lead or claim then: ``problem`` says so)."""
        if self._lower is None:
            return self._wall()
        return self._low_at(self._lower, self.monotonic())

    def error_s(self) -> float:
        """Half the width of the bounds now: how far the midpoint may be off."""
        if self._lower is None or self._upper is None:
            return float("inf")
        m = self.monotonic()
        return (self._high_at(self._upper, m) - self._low_at(self._lower, m)).total_seconds() / 2

    def offset_s(self) -> float | None:
        """The server's clock minus ours, as best known (the bounds' midpoint); None
        before the first sample."""
        if self._lower is None or self._upper is None:
            return None
        m = self.monotonic()
        middle = (
            self._low_at(self._lower, m)
            + (self._high_at(self._upper, m) - self._low_at(self._lower, m)) / 2
        )
        return (middle - self._wall()).total_seconds()

    def problem(self) -> str | None:
        """Why this process may not act on the server's time now (lead, claim), or None."""
        if self._lower is None:
            return "no reply from the database has told its time yet"
        error = self.error_s()
        if error > self.tolerance_s:
            return (
                f"the database's clock is known only within {error * 1000:.0f} ms, more "
                f"than the tolerance of {self.tolerance_s * 1000:.0f} ms (slow round "
                "trips to the database)"
            )
        return None

    def status(self) -> dict[str, float | int | str | None]:
        """For /readyz: the offset, how well it is known, and any problem."""
        offset = self.offset_s()
        return {
            "offset_s": None if offset is None else round(offset, 4),
            "error_s": None if not self.known else round(self.error_s(), 4),
            "tolerance_s": self.tolerance_s,
            "samples": self.samples,
            "problem": self.problem(),
        }
