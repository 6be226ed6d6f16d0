"""A lease history, checked offline (pure): at most one leader acts at any time.

The history holds, for each term, what the database's clock said when it was acquired,
each time it was renewed, and when it was released; and each act of a term (a fire
claimed, adopted, taken or recorded skipped with that term) with the database's time of
the write. The recorder is storage/lease_history.py.

A term is valid from its acquisition to its holder's renew deadline: the holder stops
acting ``renew_deadline`` after it *sent* its last successful renewal, which the server
handled later, so on the server's clock the holder stops no later than
``last renewal + renew_deadline`` (or at its release, which it sends after it stopped).
Nobody else can acquire the lease before ``last renewal + ttl``: the margin between the
two is there for what the holder sent before its deadline and the server applies after it
(a write held up in the network or in a stalled server).

The check: terms' validity intervals never overlap; no act lies before its term's
acquisition, nor where another term could act (after ``last renewal + ttl``, or after the
next term's acquisition). An act applied between its term's renew deadline and that point
used the margin: counted as a late landing, not a violation.
"""

from __future__ import annotations

import datetime as dt
import itertools
from dataclasses import dataclass, field
from typing import Any

# BSON dates keep whole milliseconds, truncated: two readings of the same instant may
# differ by one.
RESOLUTION = dt.timedelta(milliseconds=1)


@dataclass
class TermRecord:
    term: int
    holder: str | None
    acquired_at: dt.datetime
    last_renewed_at: dt.datetime
    released_at: dt.datetime | None = None
    renewals: int = 0

    def valid_until(self, renew_deadline_s: float) -> dt.datetime:
        end = self.last_renewed_at + dt.timedelta(seconds=renew_deadline_s)
        return min(end, self.released_at) if self.released_at is not None else end


@dataclass(frozen=True)
class Act:
    term: int
    at: dt.datetime  # the server's time of the write
    what: str  # the fire id


@dataclass
class HistoryReport:
    terms: int = 0
    renewals: int = 0
    acts: int = 0
    unverifiable: int = 0  # acts of terms acquired before the recording began
    late_landings: int = 0  # applied after the renew deadline, before anyone could act
    latest_landing_s: float = 0.0  # the most an act was applied after its renew deadline
    # Applied where another term could act: sent in time (a write is only sent before the
    # renew deadline) and held up past the margin, in the network or a stalled server.
    stale: list[Act] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.stale

    def as_dict(self) -> dict[str, Any]:
        return {
            "terms": self.terms,
            "renewals": self.renewals,
            "acts": self.acts,
            "unverifiable": self.unverifiable,
            "late_landings": self.late_landings,
            "latest_landing_s": round(self.latest_landing_s, 3),
            "stale": len(self.stale),
            "violations": len(self.violations),
            "examples": self.violations[:5]
            + [
                f"{a.what} written with term {a.term} at {a.at.isoformat()}, when "
                "another term could act"
                for a in self.stale[:5]
            ],
            "ok": self.ok,
        }


def check(
    terms: list[TermRecord], acts: list[Act], renew_deadline_s: float, ttl_s: float
) -> HistoryReport:
    """Every violation of single leadership the history shows."""
    report = HistoryReport(
        terms=len(terms), renewals=sum(t.renewals for t in terms), acts=len(acts)
    )
    by_term = {t.term: t for t in terms}
    ordered = sorted(terms, key=lambda t: t.term)
    # Where another term may act: the lease's expiry, or the next term's acquisition.
    others_from = {t.term: t.valid_until(ttl_s) for t in ordered}
    for earlier, later in itertools.pairwise(ordered):
        others_from[earlier.term] = min(others_from[earlier.term], later.acquired_at)
    for earlier, later in itertools.pairwise(ordered):
        end = earlier.valid_until(renew_deadline_s)
        if later.acquired_at + RESOLUTION < end:
            report.violations.append(
                f"term {later.term} ({later.holder}) acquired at "
                f"{later.acquired_at.isoformat()}, while term {earlier.term} "
                f"({earlier.holder}) was valid until {end.isoformat()}"
            )
    first = ordered[0].term if ordered else None
    for act in acts:
        record = by_term.get(act.term)
        if record is None:
            if first is not None and act.term < first:
                report.unverifiable += 1
            else:
                report.violations.append(
                    f"{act.what} written with term {act.term}, which no replica acquired"
                )
            continue
        end = record.valid_until(renew_deadline_s)
        if act.at + RESOLUTION < record.acquired_at:
            report.violations.append(
                f"{act.what} written with term {act.term} at {act.at.isoformat()}, before "
                f"the term was acquired ({record.acquired_at.isoformat()})"
            )
        elif act.at > others_from[act.term]:
            report.stale.append(act)
        elif act.at > end + RESOLUTION:
            report.late_landings += 1
            report.latest_landing_s = max(report.latest_landing_s, (act.at - end).total_seconds())
    return report
