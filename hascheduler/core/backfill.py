"""What one chunk of a backfill came to (pure), read from the ledger's documents for its
nominal times: the backfill's counts are derived from the ledger, so a chunk worked again
(after a failover, or after a pause sent it back) counts each claim once."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hascheduler.core.claims import PAUSED_BEFORE_DUE
from hascheduler.core.instants import as_utc

# What a backfill's record says of its claims whose publish failed for good (the fire
# ledger holds each one's error).
PUBLISH_FAILED = "publish failed (the fire's ledger entry holds the error)"


@dataclass(frozen=True)
class ChunkOutcome:
    cursor: dt.datetime  # the first nominal time still to work
    fired: int = 0  # claims of this backfill, published or on their way (buffered, retried)
    # ... and those recorded skipped at their publish, or failed to publish, by why
    held: int = 0  # claims the ledger held already: fired or recorded before
    withdrawn: dict[str, int] = field(default_factory=dict)  # skipped at their publish, why
    released: list[str] = field(default_factory=list)  # skipped by a pause: to be freed


def chunk_outcome(
    docs: Iterable[dict[str, Any]], backfill_id: str, following: dt.datetime
) -> ChunkOutcome:
    """The outcome of a chunk whose nominal times run up to ``following`` (exclusive), from
    the ledger's documents at those times (``nominal_at``, ``state``, ``reason``,
    ``backfill``). A claim of this backfill that a pause withdrew is released and the cursor
    goes back to it, so those times are fired once the schedule is resumed; what lies from
    there on is counted when the chunk is worked again."""
    docs = list(docs)
    released = [
        d
        for d in docs
        if d.get("backfill") == backfill_id
        and d.get("state") == "skipped"
        and d.get("reason") == PAUSED_BEFORE_DUE
    ]
    cursor = min((as_utc(d["nominal_at"]) for d in released), default=following)
    fired = held = 0
    withdrawn: dict[str, int] = {}
    for doc in docs:
        if as_utc(doc["nominal_at"]) >= cursor:
            continue
        if doc.get("backfill") != backfill_id:
            held += 1
        elif doc.get("state") == "skipped":
            reason = str(doc.get("reason"))
            withdrawn[reason] = withdrawn.get(reason, 0) + int(doc.get("count", 1))
        elif doc.get("state") == "failed":  # never published: not fired, and said why
            withdrawn[PUBLISH_FAILED] = withdrawn.get(PUBLISH_FAILED, 0) + 1
        else:
            fired += 1
    return ChunkOutcome(cursor, fired, held, withdrawn, [str(d["_id"]) for d in released])
