"""What a chaos soak records as it runs: the faults it injected and the lease's holder
sampled over time (read by the soak's report and by its plots)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from bench.chaos_audit import Window


@dataclass
class Fault:
    kind: str
    target: str
    started: dt.datetime
    hold_s: float
    term: int  # the lease's term when injected
    leader: bool  # the target held the lease
    settle_s: float  # after it ends, fires may still be late because of it
    ended: dt.datetime | None = None

    def window(self) -> Window:
        end = self.ended or self.started
        return self.started, end + dt.timedelta(seconds=self.settle_s)


@dataclass
class LeaseSample:
    at: dt.datetime
    holder: str | None
    term: int
