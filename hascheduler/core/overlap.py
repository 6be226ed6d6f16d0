"""Overlap policies (pure): what a fire does while its schedule's previous run is still
open (invariant 11, docs/ARCHITECTURE.md; each policy's semantics in docs/SCHEDULES.md).

A run is *open* from its fire's publish until it ends ``succeeded``, ``dead`` or
``cancelled``; a published fire no worker has claimed yet is open too. Runs are keyed by
schedule, and by tenant for a fan-out (its policy holds per tenant). The leader reads the
open runs and the waiting (buffered) fires of the keys at hand, and these functions say,
from those alone, which fires to publish, skip, buffer, and which open runs to cancel.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

ALLOW = "allow"
SKIP = "skip"
BUFFER_ONE = "buffer_one"
BUFFER_ALL = "buffer_all"
CANCEL_OTHER = "cancel_other"
Policy = Literal["allow", "skip", "buffer_one", "buffer_all", "cancel_other"]
POLICIES: tuple[str, ...] = get_args(Policy)

# What a skipped fire's ledger entry says (the open run's fire id beside it).
OVERLAP = "overlap"
BUFFER_FULL = "overlap: buffer full"

# A run's key: its schedule, and its tenant for a fan-out fire.
Key = tuple[str, str | None]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A fire about to be published, under the policy that applies to it."""

    fire_id: str
    key: Key
    nominal_at: dt.datetime
    policy: str


@dataclass
class Decision:
    publish: list[str] = field(default_factory=list)
    # Fire id -> (the reason recorded, the open run's fire id).
    skip: dict[str, tuple[str, str]] = field(default_factory=dict)
    # Fire id -> the open run's fire id it waits for.
    buffer: dict[str, str] = field(default_factory=dict)
    cancel: set[str] = field(default_factory=set)  # open runs to cancel (cancel_other)


def decide(
    candidates: Sequence[Candidate],
    open_runs: Mapping[Key, Iterable[str]],
    buffered: Mapping[Key, int],
    max_buffered: int,
) -> Decision:
    """What each candidate does, in order of nominal time. ``open_runs`` are the fire ids
    of each key's open runs (a candidate's own run may be among them: it was published
    before, and publishing it again is deduplicated); ``buffered`` counts each key's fires
    already waiting, which keep their place ahead of any new one."""
    out = Decision()
    opened: dict[Key, list[str]] = {k: list(v) for k, v in open_runs.items()}
    waiting = dict(buffered)
    for c in sorted(candidates, key=lambda c: (c.nominal_at, c.fire_id)):
        others = [f for f in opened.get(c.key, ()) if f != c.fire_id]
        queued = waiting.get(c.key, 0)
        if c.policy == ALLOW or (not others and not queued):
            out.publish.append(c.fire_id)
            opened.setdefault(c.key, []).append(c.fire_id)
            continue
        blocker = others[0] if others else ""
        if c.policy == BUFFER_ALL and queued < max_buffered:
            out.buffer[c.fire_id] = blocker
            waiting[c.key] = queued + 1
        elif c.policy in (BUFFER_ONE, CANCEL_OTHER) and not queued:
            out.buffer[c.fire_id] = blocker
            waiting[c.key] = 1
            if c.policy == CANCEL_OTHER:
                out.cancel.update(others)
        else:
            reason = BUFFER_FULL if c.policy == BUFFER_ALL else OVERLAP
            out.skip[c.fire_id] = (reason, blocker)
    return out
