"""The dashboard's timeline (pure): each fire as a mark of one kind, and lateness over the
window in buckets (docs/OPERATIONS.md, "The dashboard").

A mark's kind is the worst that holds of its fire and its run, in SEVERITY order: a late
fire whose run died is ``dead``; a fan-out fire is the worst of its tenants'.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hascheduler.core.run_states import PENDING, RETRYING, RUNNING

# A published fire this much after its due time is ``late`` (the lateness objective the
# shipped alert rules burn against: k8s/monitoring/rules.yaml, le="1.0").
LATE_MARK_S = 1.0
SEVERITY = ("dead", "failed", "late", "skipped", "cancelled", "running", "waiting", "on_time")
_OPEN_RUN = frozenset({PENDING, RUNNING, RETRYING})
_WAITING_FIRE = frozenset({"requested", "claimed", "buffered"})


def kind_of(fire_state: str, lateness_s: float | None, run_state: str | None) -> str:
    if run_state == "dead":
        return "dead"
    if fire_state == "failed":
        return "failed"
    if fire_state == "skipped":
        return "skipped"
    if lateness_s is not None and lateness_s >= LATE_MARK_S:
        return "late"
    if run_state == "cancelled":
        return "cancelled"
    if run_state in _OPEN_RUN:
        return "running"
    if fire_state in _WAITING_FIRE:
        return "waiting"
    return "on_time"


def worst(kinds: Iterable[str]) -> str:
    return min(kinds, key=SEVERITY.index, default="on_time")


@dataclass(frozen=True, slots=True)
class Bucket:
    start: dt.datetime
    count: int
    p50_s: float | None
    p99_s: float | None
    max_s: float | None


def _rank(ordered: Sequence[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def lateness_buckets(
    samples: Iterable[tuple[dt.datetime, float]],
    since: dt.datetime,
    until: dt.datetime,
    buckets: int,
) -> list[Bucket]:
    """Lateness of published fires (due time, seconds late) in ``buckets`` equal spans of
    [since, until): count, p50, p99 (nearest rank) and max of each."""
    span = (until - since) / buckets
    found: list[list[float]] = [[] for _ in range(buckets)]
    for due, late in samples:
        if since <= due < until:
            found[min(buckets - 1, int((due - since) / span))].append(late)
    out = []
    for i, values in enumerate(found):
        values.sort()
        out.append(
            Bucket(
                since + i * span,
                len(values),
                _rank(values, 0.5) if values else None,
                _rank(values, 0.99) if values else None,
                values[-1] if values else None,
            )
        )
    return out
